"""Optional dependencies, checked in one place so that a missing extra fails early with the install command."""

from __future__ import annotations

from lightning_utilities.core.imports import RequirementCache

_JSONARGPARSE = RequirementCache("jsonargparse[signatures]>=4.27")


def require_cli() -> None:
    if not _JSONARGPARSE:
        raise ModuleNotFoundError(
            f"The pl-lowprec command line needs jsonargparse: {_JSONARGPARSE.message}."
            ' Install it with: pip install "pl_lowprec[cli]"'
        )
