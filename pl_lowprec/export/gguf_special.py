"""The special tokens of a GGUF's tokenizer, for both kinds of vocabulary (``gguf_vocab``, ``gguf_vocab_spm``).

- which added tokens llama.cpp treats as control (``does_token_look_special``) and how a user-defined one is
  spelled in the file;
- the special token ids, ``add_bos_token``/``add_eos_token`` and the chat template, through the ``gguf`` package's
  own ``SpecialVocab``, which reads them from the directory as llama.cpp's converter does.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

METASPACE = "\u2581"  # SentencePiece's visible space


def looks_special(token: str) -> bool:
    """Added tokens llama.cpp treats as control even when not marked special (``does_token_look_special``)."""
    return (
        token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<\uff5c") and token.endswith("\uff5c>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )


def user_defined_text(token: str) -> str:
    """A user-defined token as llama.cpp matches it in raw text: its ``▁`` are spaces (llama.cpp's converters
    "pre-normalize user-defined spaces")."""
    return token.replace(METASPACE, " ")


@contextmanager
def _without_pair_template_warning() -> Iterator[None]:
    """``SpecialVocab`` warns when a tokenizer's pair template (two sequences) adds other special tokens than its
    single one, as the demo's does; llama.cpp only ever encodes single sequences, so nothing is wrong to report."""

    def keep(record: logging.LogRecord) -> bool:
        return "TemplateProcessing<pair>" not in record.getMessage()

    logger = logging.getLogger("gguf.vocab")
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def special_vocab(gguf: Any, directory: Path, vocab_size: int, load_merges: bool) -> Any:
    """``gguf.SpecialVocab`` of ``directory``: special ids, add_bos/add_eos, chat template (and merges if asked)."""
    with _without_pair_template_warning():
        return gguf.SpecialVocab(str(directory), load_merges=load_merges, n_vocab=vocab_size)


def added_special_tokens(tokenizer: Any) -> dict[str, bool]:
    """Whether ``tokenizer`` adds BOS and EOS to a text, as loaded: what the model saw in training, whatever the
    config files say (transformers 5 rebuilds a Llama tokenizer's post-processor from its own defaults)."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a")["input_ids"]
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    return {
        "bos": bos is not None and full[:1] == [bos] and plain[:1] != [bos],
        "eos": eos is not None and full[-1:] == [eos] and plain[-1:] != [eos],
    }
