"""``chat_template_kwargs`` that the chat template never reads: refused, not passed on to no effect.

``apply_chat_template`` hands every extra keyword to the template, which ignores those it does not use:
``enable_thinking`` under a template without a thinking switch, or a misspelt ``enable_thinkng``, changed nothing
and said nothing, and the run trained with the template's default (Qwen3's: thinking on). An argument counts as
read where its name is a word of the template's source (of any of a tokenizer's named templates).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterable
from typing import Any

from pl_lowprec._did_you_mean import closest

WORD = re.compile(r"[A-Za-z_]\w*")


@functools.lru_cache(maxsize=8)  # once per tokenizer, not per record
def template_words(tokenizer: Any) -> frozenset[str]:
    """The names in the tokenizer's chat template sources; empty where it has none."""
    template = getattr(tokenizer, "chat_template", None)
    sources = template.values() if isinstance(template, dict) else [template] if template else []
    return frozenset(word for source in sources for word in WORD.findall(source))


def unread_arguments(names: Iterable[str], words: frozenset[str]) -> list[str]:
    """The argument ``names`` none of the template ``words`` is."""
    return [name for name in names if name not in words]


def check_template_arguments(
    tokenizer: Any, kwargs: dict[str, Any], tokenizer_dir: str, given: str | None = None
) -> None:
    """The data module's ``chat_template_kwargs`` (or ``generate``'s, named by ``given``) against the template,
    before any record is read."""
    words = template_words(tokenizer)
    unread = unread_arguments(kwargs, words) if words else []
    if not unread:
        return
    name = unread[0]
    near = closest(name, words)
    given = given or f"TextDataModule(chat_template_kwargs={kwargs!r})"
    raise ValueError(
        f"{given}: the chat template of the tokenizer in {tokenizer_dir!r}"
        f" never reads {name!r}" + (f" (did you mean {near!r}?)" if near else "") + ". apply_chat_template passes"
        " arguments a template does not use without a word, so it would change nothing and the template's default"
        " would apply. Fix: name an argument the template reads (its {% if ... %} tests name them), or leave it"
        " out."
    )
