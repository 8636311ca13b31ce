"""A text's tokens with each special token once, where the text and the tokenizer both put one.

A text may carry its own BOS and EOS: a ``text`` column rendered by ``apply_chat_template(tokenize=False)``
starts with ``<s>``, a completion may end with ``</s>``. A tokenizer may add them too: most add BOS, and
``LlamaTokenizerFast(add_eos_token=True)`` (common in Llama-2 recipes) appends EOS. Tokenized as they come, such a
text trains ``<s> <s>`` at its start and ``</s> </s>`` at its end, and the model learns EOS -> EOS. So a token the
tokenizer added next to the same token written in the text is dropped, and EOS is appended only where the ids do
not end with one already (TRL's ``add_eos``).

Whitespace after a text's final EOS (``"... </s>\n"``: a rendered chat template's last line ending, or a file's)
is not content: kept, the ids ended with a newline, another EOS was appended, and the model learnt EOS -> newline
-> EOS. So it is dropped, and the text ends with its own EOS (``without_space_after_eos``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Tokens:
    """A text's token ids; ``offsets``: each token's characters in the text, ``(0, 0)`` for a token the tokenizer
    added (only where asked for); ``added``: whether the tokenizer added the token (BOS, an EOS of its own)."""

    ids: list[int]
    added: list[bool]
    offsets: list[tuple[int, int]]
    bos_kept_once: bool  # the text starts with the BOS the tokenizer adds too: the tokenizer's was dropped
    space_after_eos_dropped: bool = False  # the text ended with EOS then whitespace, which was not tokenized

    def ends_with(self, token_id: int) -> bool:
        return bool(self.ids) and self.ids[-1] == token_id

    def written_last(self, token_id: int) -> bool:
        """Whether the text itself ends with ``token_id`` (written in it, not added by the tokenizer)."""
        return self.ends_with(token_id) and not self.added[-1]


def tokens_once(tokenizer: Any, text: str, offsets: bool = False) -> Tokens:
    """``text`` tokenized with the tokenizer's special tokens, less any it added next to the same token in the
    text, and less any whitespace after its final EOS; with the character ``offsets`` of each token where asked (a
    fast tokenizer's)."""
    trimmed = without_space_after_eos(text, tokenizer.eos_token)
    encoded = tokenizer(trimmed, return_special_tokens_mask=True, return_offsets_mapping=offsets)
    ids, added = list(encoded["input_ids"]), [bool(m) for m in encoded["special_tokens_mask"]]
    spans = [tuple(span) for span in encoded["offset_mapping"]] if offsets else [(0, 0)] * len(ids)
    doubled = {i for i, was_added in enumerate(added) if was_added and _beside_in_text(ids, added, i)}
    bos_kept_once = 0 in doubled and ids[0] == tokenizer.bos_token_id
    if doubled:  # usually none: the lists stay as the tokenizer gave them
        keep = [i for i in range(len(ids)) if i not in doubled]
        ids, added, spans = [ids[i] for i in keep], [added[i] for i in keep], [spans[i] for i in keep]
    return Tokens(ids, added, spans, bos_kept_once, space_after_eos_dropped=trimmed != text)


def without_space_after_eos(text: str, eos_token: str | None) -> str:
    """``text`` less the whitespace after its final ``eos_token``; as it is where it does not end so."""
    content = text.rstrip()
    return content if eos_token and content != text and content.endswith(eos_token) else text


def _beside_in_text(ids: list[int], added: list[bool], i: int) -> bool:
    """Whether the token before or after ``i`` is the same token, written in the text."""
    return any(0 <= j < len(ids) and ids[j] == ids[i] and not added[j] for j in (i - 1, i + 1))
