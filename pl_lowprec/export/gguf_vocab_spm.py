"""A SentencePiece-style tokenizer (BPE with byte fallback: Llama 2, TinyLlama, Mistral 7B) in a GGUF's metadata,
as llama.cpp's converter writes it (``_set_vocab_sentencepiece``): ``tokenizer.ggml.model = llama``.

llama.cpp tokenizes such a file with its SPM tokenizer (``llm_tokenizer_spm_session``): spaces become ``▁`` (one
is prepended when ``add_space_prefix``), then the adjacent pair whose joined text is the token of highest *score*
is merged, again and again, and what no token covers is spelled with the ``<0xNN>`` byte tokens. Its converter reads
the scores from ``tokenizer.model`` with sentencepiece; a fine-tune's directory holds the ``tokenizer.json`` that
transformers loads (and trained with), whose merges are SentencePiece's, ranked by score. So each token's score here
is minus the rank of its first merge, and llama.cpp merges in the order transformers does, provided the merges are
the ones that rule implies (``gguf_merge_order``; a BPE trained otherwise is refused). transformers' GGUF reader
rebuilds its merges from these scores the same way.

Token types as llama.cpp's converter sets them: ``<0xNN>`` byte tokens BYTE (llama.cpp decodes them to the byte,
and falls back on them), special added tokens (and those that look special) CONTROL, other added tokens
USER_DEFINED (matched whole in raw text), rows past the tokenizer ``[PAD<i>]`` UNUSED; the unknown token UNKNOWN,
as sentencepiece marks it (llama.cpp's converter then makes it CONTROL when it is a special added token; llama.cpp
treats the two alike).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pl_lowprec.export.gguf_merge_order import first_merge_ranks, merge_problem
from pl_lowprec.export.gguf_special import (
    METASPACE,
    added_special_tokens,
    looks_special,
    special_vocab,
    user_defined_text,
)

BYTE_TOKEN = re.compile(r"<0x[0-9A-F]{2}>")
ADDED_SCORE = -1000.0  # llama.cpp's converter scores added tokens and padding rows so
BYTE_SCORE = 0.0  # as SentencePiece scores its byte pieces


def _refuse(source: str | Path, problem: str) -> ValueError:
    return ValueError(
        f"The tokenizer of {str(source)!r} is a SentencePiece-style BPE (byte fallback), which --format gguf writes"
        f" for llama.cpp's SentencePiece tokenizer (tokenizer.ggml.model = llama), but {problem} Export --format"
        " merged and convert with llama.cpp's convert_hf_to_gguf.py."
    )


def space_prefix(tokenizer_json: dict[str, Any]) -> bool | None:
    """Whether the tokenizer prepends ``▁`` to a text (llama.cpp's ``add_space_prefix``), or None when it does not
    split text as SentencePiece does: spaces replaced by ``▁``, the text kept whole (a ``Metaspace`` that does not
    split, or the older ``Prepend``/``Replace`` normalizer)."""
    normalizer = tokenizer_json.get("normalizer") or {}
    pre = tokenizer_json.get("pre_tokenizer") or {}
    if not normalizer and pre.get("type") == "Metaspace":
        if pre.get("replacement") != METASPACE or pre.get("split", True):
            return None
        return pre.get("prepend_scheme", "always") != "never"
    steps = normalizer.get("normalizers", []) if normalizer.get("type") == "Sequence" else [normalizer]
    replace = {"type": "Replace", "pattern": {"String": " "}, "content": METASPACE}
    if pre or not steps or steps[-1] != replace:
        return None
    if len(steps) == 1:
        return False
    if len(steps) == 2 and steps[0] == {"type": "Prepend", "prepend": METASPACE}:
        return True
    return None


def merge_pairs(model: dict[str, Any]) -> list[tuple[str, str]]:
    """The BPE merges of ``tokenizer.json``'s model, in rank order (pairs, or older ``"a b"`` strings)."""
    return [tuple(m) if isinstance(m, list) else tuple(m.split(" ", 1)) for m in model.get("merges", [])]


def check_sentencepiece(tokenizer_json: dict[str, Any], source: str | Path) -> bool:
    """``add_space_prefix`` for a SentencePiece-style ``tokenizer.json``; a ``ValueError`` with the fix when llama.cpp
    would tokenize differently from it (checked before any weights load)."""
    model = tokenizer_json.get("model") or {}
    for option in ("dropout", "continuing_subword_prefix", "end_of_word_suffix", "ignore_merges"):
        if model.get(option):
            raise _refuse(source, f"its BPE sets {option}={model[option]!r}, which llama.cpp does not apply.")
    prefix = space_prefix(tokenizer_json)
    if prefix is None:
        found = {key: tokenizer_json.get(key) for key in ("normalizer", "pre_tokenizer")}
        raise _refuse(
            source,
            f"it splits text otherwise than SentencePiece ({json.dumps(found)[:200]}): llama.cpp replaces spaces"
            " with '\u2581' and keeps the text whole (a Metaspace with split=false, or the Prepend/Replace"
            " normalizer).",
        )
    vocab = model.get("vocab") or {}
    missing = [f"<0x{b:02X}>" for b in range(256) if f"<0x{b:02X}>" not in vocab]
    if missing:
        raise _refuse(
            source,
            f"it lacks {len(missing)} of the 256 byte tokens ({', '.join(missing[:3])}...) that llama.cpp spells"
            " unknown text with.",
        )
    problem = merge_problem(vocab, merge_pairs(model))
    if problem is not None:
        raise _refuse(source, f"its merges are not the ones SentencePiece's rule implies: {problem}.")
    return prefix


def sentencepiece_vocabulary(
    tokenizer: Any, model: dict[str, Any], vocab_size: int, token_types: Any
) -> tuple[list[str], list[float], list[int]]:
    """The tokens, scores and types, one per embedding row (``_create_vocab_sentencepiece``); ``model`` is the
    tokenizer's serialized BPE model."""
    merges = merge_pairs(model)
    ranks = first_merge_ranks(merges)
    reverse = {index: token for token, index in tokenizer.get_vocab().items()}
    decoder = tokenizer.added_tokens_decoder
    tokens: list[str] = []
    scores: list[float] = []
    types: list[int] = []
    for index in range(vocab_size):
        token = reverse.get(index)
        if token is None:
            token, score, kind = f"[PAD{index}]", ADDED_SCORE, token_types.UNUSED
        elif index in decoder:
            score = ADDED_SCORE
            if token == tokenizer.unk_token:
                kind = token_types.UNKNOWN
            elif decoder[index].special or looks_special(token):
                kind = token_types.CONTROL
            else:
                token, kind = user_defined_text(token), token_types.USER_DEFINED
        elif BYTE_TOKEN.fullmatch(token):
            score, kind = BYTE_SCORE, token_types.BYTE
        else:
            score, kind = -float(ranks.get(token, len(merges))), token_types.NORMAL
        tokens.append(token)
        scores.append(score)
        types.append(int(kind))
    return tokens, scores, types


def check_unique(tokens: list[str], source: str | Path) -> None:
    """llama.cpp refuses a file whose token list has one text twice (``duplicate token in vocabulary``)."""
    seen: dict[str, int] = {}
    for index, token in enumerate(tokens):
        if token in seen:
            raise _refuse(
                source,
                f"tokens {seen[token]} and {index} would both be {token!r} in the file (an added token with '\u2581'"
                " is written with spaces, as llama.cpp matches it), and llama.cpp refuses a repeated token.",
            )
        seen[token] = index


def add_sentencepiece_vocabulary(
    writer: Any, gguf: Any, directory: Path, tokenizer: Any, tokenizer_json: dict[str, Any], vocab_size: int
) -> dict[str, Any]:
    """Write ``tokenizer`` (loaded from ``directory``; ``tokenizer_json``, its serialization, passed
    ``check_sentencepiece``) into ``writer``; what was written."""
    prefix = bool(space_prefix(tokenizer_json))
    tokens, scores, types = sentencepiece_vocabulary(tokenizer, tokenizer_json["model"], vocab_size, gguf.TokenType)
    check_unique(tokens, directory)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_add_space_prefix(prefix)
    special = special_vocab(gguf, directory, vocab_size, load_merges=False)
    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise: say what the tokenizer does
    special.add_special_token.update(added_special_tokens(tokenizer))
    special.add_to_gguf(writer, quiet=True)
    return {
        "model": "llama",
        "pre": "default",
        "tokens": len(tokens),
        "merges": len(merge_pairs(tokenizer_json["model"])),
        "add_space_prefix": prefix,
        "special_ids": dict(special.special_token_ids),
        "add_special": dict(special.add_special_token),
        "chat_template": special.chat_template,
        "token_text": tokens,
    }
