"""An assistant turn the chat template ends with no end-of-turn token: refused, or given the tokenizer's EOS.

The loss on an assistant turn includes the token that ends it (``</s>``, ``<|im_end|>``, ``<|eot_id|>``): that is
how the fine-tuned model learns to stop, and what ``generate`` stops on. A template that ends a turn with a
newline alone (``{{ role }}: {{ content }}\\n``, as base models' ad-hoc templates do) trains no such token: the model
never stops, and writes the next turn itself up to ``max_new_tokens``. Neither TRL nor axolotl appends one (TRL
renders the template as it is; axolotl logs "EOS token ... not found in chat_template"), and a log line is easily
missed, so here it is refused before any step unless ``eos_after_turns`` says what to do:

- ``None`` (the default): refused, naming the template's rendering of the turn and both fixes;
- ``True``: the tokenizer's EOS written right after each such turn's text, trained as its end, as if the template
  wrote ``{{ eos_token }}`` there (LLaMA-Factory's templates end each answer with it);
- ``False``: the turns trained as the template writes them (the user stops generation otherwise, on a string).

A turn whose text ends with a special token (the template's, or one in the answer itself) is left as it is.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from pl_lowprec.models.token_loss import IGNORE_INDEX

SHOWN_CHARS = 40


class NoTurnEnd(ValueError):
    """An assistant turn that ends with no end-of-turn token under ``eos_after_turns=None``; the data module
    names the file and line."""


def no_turn_end_message(rendered_end: str, eos_token: str | None) -> str:
    """The refusal: what the template writes at the turn's end, why it trains wrong, and the fixes."""
    append = (
        f"pass --data.eos_after_turns true to write the tokenizer's EOS {eos_token!r} after each assistant turn that"
        " has none, trained as its end (as LLaMA-Factory's templates end answers);"
        if eos_token
        else "give the tokenizer an EOS token;"
    )
    return (
        f"the chat template ends an assistant turn with no end-of-turn token (its text ends {rendered_end!r}): the"
        " model would learn no token that ends its answer, and generate would not stop after it but write the"
        " next turn itself, up to max_new_tokens. Chat models' templates end each turn with one (</s>,"
        " <|im_end|>, <|eot_id|>). Fix: give --data.tokenizer a template that writes it after each assistant turn"
        f" (e.g. {{{{ message['content'] }}}}{{{{ eos_token }}}}), or {append} --data.eos_after_turns false trains"
        " the turns as the template writes them, where you stop generation otherwise (a stop string)."
    )


def ended_spans(
    text: str, spans: list[tuple[int, int]], special: Collection[str], eos_token: str | None, policy: bool | None
) -> tuple[str, list[tuple[int, int]]]:
    """``text`` and its assistant character ``spans``, each ending at its end-of-turn token: a span whose text ends
    with a special token loses the whitespace after it (the separator a template writes between turns), one that
    ends with none is refused (``policy=None``), given the EOS after its text (``True``; the spans after it
    shifted), or kept whole (``False``)."""
    ended: list[tuple[int, int]] = []
    shift = 0
    for start, end in spans:
        start, end = start + shift, end + shift
        body = text[start:end].rstrip()
        if any(token and body.endswith(token) for token in special):
            ended.append((start, start + len(body)))
            continue
        if policy is False:
            ended.append((start, end))
            continue
        if policy is None or not eos_token:
            raise NoTurnEnd(no_turn_end_message(text[max(start, end - SHOWN_CHARS) : end], eos_token))
        at = start + len(body)
        text = text[:at] + eos_token + text[at:]
        shift += len(eos_token)
        ended.append((start, at + len(eos_token)))
    return text, ended


def ended_marks(ids: list[int], labels: list[int], tokenizer: Any, special_ids: Collection[int], policy: bool | None):
    """The same for a template's ``{% generation %}`` marks: each run of targets whose last token that is not
    whitespace is no special token is refused, or given the EOS id after that token (in place: the caller's own
    lists), or kept."""
    if policy is False:
        return ids, labels
    runs, i = [], 0
    while i < len(labels):
        if labels[i] == IGNORE_INDEX:
            i += 1
            continue
        first = i
        while i < len(labels) and labels[i] != IGNORE_INDEX:
            i += 1
        runs.append((first, i))
    for first, stop in reversed(runs):  # from the end: an insertion leaves the earlier runs' indices as they are
        last = next((k for k in range(stop - 1, first - 1, -1) if tokenizer.decode([ids[k]]).strip()), stop - 1)
        if ids[last] in special_ids:
            continue
        if policy is None or tokenizer.eos_token_id is None:
            rendered = tokenizer.decode(ids[first:stop])[-SHOWN_CHARS:]
            raise NoTurnEnd(no_turn_end_message(rendered, tokenizer.eos_token))
        ids.insert(last + 1, tokenizer.eos_token_id)
        labels.insert(last + 1, tokenizer.eos_token_id)
    return ids, labels
