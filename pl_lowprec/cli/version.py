"""``pl-lowprec --version``: this package's version and those of what it runs on, for a bug report (as
``accelerate env`` and ``transformers env`` print theirs). LightningCLI has no ``--version``: it refused it as
"unrecognized arguments"."""

from __future__ import annotations

import platform
from importlib.metadata import PackageNotFoundError, version

import torch

import pl_lowprec

LIBRARIES = ("lightning", "transformers", "peft", "bitsandbytes", "torchao")  # the ones a run's numbers depend on


def installed(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def version_text() -> str:
    """One ``name version`` line each: pl_lowprec, Python and the platform, torch with its accelerator, then
    ``LIBRARIES`` (read from the installed metadata, nothing imported)."""
    if torch.cuda.is_available():
        names = sorted({torch.cuda.get_device_name(index) for index in range(torch.cuda.device_count())})
        accelerator = f"CUDA {torch.version.cuda}, {torch.cuda.device_count()} x {', '.join(names)}"
    else:
        accelerator = "no CUDA device"
    lines = [
        f"pl_lowprec {pl_lowprec.__version__}",
        f"python {platform.python_version()} ({platform.platform()})",
        f"torch {torch.__version__} ({accelerator})",
        *(f"{name} {installed(name)}" for name in LIBRARIES),
    ]
    return "\n".join(lines)
