"""Put this package's callbacks in place of Lightning's own classes (its defaults, or the same classes a user
named), never in place of a user's subclass."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any


def swap_default_callbacks(trainer: Any, swaps: Mapping[type, Callable[[Any], Any]]) -> None:
    """Replace each callback whose exact type is a key of ``swaps`` (Lightning's class: a user's subclass is a
    different type) by ``swaps[type](callback)``, in the same place of ``trainer.callbacks``."""
    for index, callback in enumerate(trainer.callbacks):
        make = swaps.get(type(callback))
        if make is not None:
            trainer.callbacks[index] = make(callback)


def in_place(new_class: type) -> Callable[[Any], Any]:
    """A swap that changes a callback's class and keeps the object: its arguments, and what Lightning's ``setup``
    already gave it, so the swap may come after the callbacks' ``setup`` (as the strategies' does)."""

    def change(callback: Any) -> Any:
        callback.__class__ = new_class
        return callback

    return change
