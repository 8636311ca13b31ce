"""The value a user meant, for the "did you mean" of a refusal: one search for every refusal that suggests one
(precisions, strategy names, subcommands, options, files)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping


def closest(
    value: str,
    choices: Iterable[str],
    cutoff: float | None = 0.6,
    spellings: Mapping[str, str] | None = None,
    ignore_case: bool = False,
) -> str | None:
    """The choice ``value`` means: with ``ignore_case``, the one that differs only in case (``'AUTO'``); then its
    other spelling in ``spellings`` (keyed lower-case with ``ignore_case``: ``'fp16'`` for ``'16-mixed'``), where
    that is a choice; then the nearest by spelling (difflib's ratio at least ``cutoff``; ``None``: not searched).
    ``None`` where nothing is close."""
    choices = list(choices)
    key = value.lower() if ignore_case else value
    if ignore_case:
        same = [choice for choice in choices if choice.lower() == key]
        if same:
            return same[0]
    spelled = (spellings or {}).get(key)
    if spelled in choices:
        return spelled
    if cutoff is None:
        return None
    nearest = difflib.get_close_matches(value, choices, n=1, cutoff=cutoff)
    return nearest[0] if nearest else None


def did_you_mean(meant: str | None) -> str:
    """``" Did you mean 'x'?"`` to end a refusal's sentence, or nothing."""
    return f" Did you mean {meant!r}?" if meant else ""
