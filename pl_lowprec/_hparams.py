"""Hyperparameters a checkpoint can be read back with: ``torch.load``'s ``weights_only=True`` (torch's default
since 2.6, and Lightning's ``Trainer.fit(ckpt_path=...)`` and ``load_from_checkpoint`` keep it) refuses any
class it does not know, ``pathlib.PosixPath`` included, so a ``Path`` argument is saved as its string. Files that
already hold paths (written before, or by a user's own module's ``save_hyperparameters``) are read by the
strategies and ``pl-lowprec``'s own readers with the path classes allowed (``path_globals``): unpickling a path
only builds it, running no other code."""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from pathlib import Path, PosixPath, PurePath, PurePosixPath, PureWindowsPath, WindowsPath
from typing import Any

import torch

PATH_CLASSES = [Path, PosixPath, WindowsPath, PurePath, PurePosixPath, PureWindowsPath]


@contextmanager
def path_globals() -> Iterator[None]:
    """``torch.load(weights_only=True)`` inside reads ``pathlib`` paths in a checkpoint's hyperparameters."""
    with torch.serialization.safe_globals(PATH_CLASSES):
        yield


def paths_as_strings(hparams: MutableMapping[str, Any]) -> None:
    """Replace, in place, each ``Path`` in ``hparams`` (in lists, tuples and dicts too) by its string."""
    for name, value in hparams.items():
        hparams[name] = _plain(value)


def _plain(value: Any) -> Any:
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value
