"""Numeric arguments checked where they enter, not where they divide.

A zero batch size, step count or head count otherwise surfaces much later as ``ZeroDivisionError`` or a
tensor-shape error far from the argument. ``check_*`` raise ``ValueError`` naming ``Owner(name=value)``, the
allowed range and what the value means; the ``*_arg`` functions are the same checks as argparse ``type=``s.
``CannotRunHere`` is the refusal of a setting this machine cannot run.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def check_at_least(owner: str, minimum: int, hint: str = "", **values: float) -> None:
    """``ValueError`` for the first value that is not an integer >= ``minimum``."""
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(f"{owner}({name}={value!r}) must be an integer >= {minimum}.{_hint(hint)}")


def check_positive(owner: str, hint: str = "", **values: float) -> None:
    """``ValueError`` for the first value that is not a finite number > 0."""
    for name, value in values.items():
        if not _finite(value) or value <= 0:
            raise ValueError(f"{owner}({name}={value!r}) must be a finite number > 0.{_hint(hint)}")


def check_fraction(
    owner: str, low_open: bool = False, high_open: bool = False, hint: str = "", **values: float
) -> None:
    """``ValueError`` for the first value outside [0, 1] (``low_open``/``high_open`` leave out 0 or 1)."""
    for name, value in values.items():
        low_ok = _finite(value) and (value > 0 if low_open else value >= 0)
        if not low_ok or not (value < 1 if high_open else value <= 1):
            interval = f"{'(' if low_open else '['}0, 1{')' if high_open else ']'}"
            raise ValueError(f"{owner}({name}={value!r}) must be in {interval}.{_hint(hint)}")


def check_model_sizes(owner: str, width: tuple[str, int], heads: tuple[str, int], **sizes: int) -> None:
    """Sizes >= 1 and a width that the heads divide (attention splits it into equal head dimensions)."""
    (width_name, width_value), (heads_name, heads_value) = width, heads
    check_at_least(owner, 1, **{width_name: width_value, heads_name: heads_value}, **sizes)
    if width_value % heads_value:
        raise ValueError(
            f"{owner}({width_name}={width_value}, {heads_name}={heads_value}): {width_name} must be a multiple of"
            f" {heads_name}, e.g. {width_name}={width_value - width_value % heads_value or heads_value}."
        )


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _hint(hint: str) -> str:
    return f" {hint}" if hint else ""


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type=``: an integer >= ``minimum``, else argparse's one-line error."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is too small: give an integer >= {minimum}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def float_in(low: float, high: float, low_open: bool = True, high_open: bool = False) -> Callable[[str], float]:
    """An argparse ``type=``: a finite float in the interval, else argparse's one-line error."""
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if math.isinf(high):
        interval = f"{'> ' if low_open else '>= '}{low:g}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        inside = (value > low if low_open else value >= low) and (value < high if high_open else value <= high)
        if not math.isfinite(value) or not inside:
            raise argparse.ArgumentTypeError(f"{value:g} is not {'' if math.isinf(high) else 'in '}{interval}")
        return value

    parse.__name__ = f"number in {interval}"
    return parse


class CannotRunHere(RuntimeError):
    """A configuration this machine cannot run (an FP8 recipe on a CPU, no C++ compiler for inductor).

    A ``RuntimeError``, as it is about the machine rather than the value, and a refusal that ``pl-lowprec``
    prints as one paragraph."""


class ResumeRefused(ValueError):
    """A checkpoint that this run cannot resume from, found while Lightning restores it: after the loops' progress
    came back from the checkpoint (so batches appear started) and before any step of this run."""
