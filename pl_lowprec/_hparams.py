"""Hyperparameters a checkpoint can be read back with: ``torch.load``'s ``weights_only=True`` (torch's default
since 2.6, and Lightning's ``Trainer.fit(ckpt_path=...)`` and ``load_from_checkpoint`` keep it) refuses any
class it does not know, ``pathlib.PosixPath`` included, so a ``Path`` argument is saved as its string."""

from __future__ import annotations

from collections.abc import MutableMapping
from pathlib import PurePath
from typing import Any


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
