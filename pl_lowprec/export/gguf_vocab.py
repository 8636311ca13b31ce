"""The tokenizer in a GGUF's metadata, as llama.cpp's converter writes it; here byte-level BPE (``_set_vocab_gpt2``),
and the choice between it and SentencePiece-style BPE (``gguf_vocab_spm``), by the tokenizer's BPE model.

- ``tokenizer.ggml.model = gpt2``, the vocabulary in its byte-level spelling, a type per token (control for
  special added tokens and those that look special, user-defined for other added tokens, unused for the
  ``[PAD{i}]`` rows that pad the vocabulary to the embedding's size) — ``TextModel.get_vocab_base``;
- merges, special token ids (bos/eos/unk/pad), ``add_bos_token``/``add_eos_token`` and the chat template through
  the ``gguf`` package's own ``SpecialVocab``, which reads them from the directory as llama.cpp does;
- ``tokenizer.ggml.pre``, the name of the text splitting llama.cpp applies before BPE. llama.cpp's converter
  recognises it by hashing the tokenizer's output on a test string, which only works for vocabularies it has
  seen; here it is read from the loaded tokenizer's pre-tokenizer (transformers rebuilds Qwen2's, for one,
  whatever tokenizer.json says), and a splitting that is not one of ``PRE_TOKENIZERS`` is refused: llama.cpp
  would split text differently from the tokenizer the model learned.

Other tokenizer models are refused: Unigram (llama.cpp's ``llama`` tokenizer merges pairs by score, which is not a
Unigram model's most likely segmentation), WordPiece and WordLevel (no llama.cpp tokenizer for a Llama or Qwen2).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pl_lowprec.export.gguf_special import looks_special, special_vocab, user_defined_text
from pl_lowprec.export.gguf_vocab_spm import add_sentencepiece_vocabulary, check_sentencepiece
from pl_lowprec.loading.tokenizer import load_tokenizer

# llama.cpp's pre-tokenizer names (llama-vocab.cpp), by the splitting tokenizer.json declares.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = {
    "gpt-2": "byte-level with GPT-2's regex (GPT-2, and tokenizers trained like the demo's)",
    "smollm": "single digits, then byte-level with GPT-2's regex (SmolLM, SmolLM2)",
    "llama-bpe": "Llama 3's regex, then byte-level (Llama 3.x)",
    "qwen2": "Qwen2's regex, then byte-level (Qwen2, Qwen2.5)",
}


def pre_tokenizer(tokenizer_json: dict[str, Any]) -> str | None:
    """llama.cpp's name for the splitting ``tokenizer.json`` declares, or None when it is not one it names."""
    steps = tokenizer_json.get("pre_tokenizer") or {}
    steps = steps.get("pretokenizers", []) if steps.get("type") == "Sequence" else [steps]
    kinds = [step.get("type") for step in steps]
    if not steps or kinds[-1] != "ByteLevel" or steps[-1].get("add_prefix_space"):
        return None
    byte_level_regex = steps[-1].get("use_regex", True)
    if kinds == ["ByteLevel"] and byte_level_regex:
        return "gpt-2"
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits") and byte_level_regex:
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not byte_level_regex:
        split = steps[0]
        pattern = (split.get("pattern") or {}).get("Regex")
        if split.get("behavior") == "Isolated" and not split.get("invert"):
            return {LLAMA3_SPLIT: "llama-bpe", QWEN2_SPLIT: "qwen2"}.get(pattern)
    return None


def tokenizer_model(tokenizer_json: dict[str, Any]) -> str | None:
    """llama.cpp's ``tokenizer.ggml.model`` for the BPE of ``tokenizer.json``: ``llama`` for SentencePiece-style
    (byte fallback), ``gpt2`` for byte-level (with merges); None for what neither tokenizer reproduces."""
    model = tokenizer_json.get("model") or {}
    if model.get("type") != "BPE" or not model.get("merges"):
        return None
    return "llama" if model.get("byte_fallback") else "gpt2"


def check_tokenizer(tokenizer: Any, source: str | Path, vocab_size: int) -> str:
    """``tokenizer.ggml.model`` for ``tokenizer`` as loaded (transformers may rebuild a model type's splitting over
    what tokenizer.json says, and the loaded one is what the model learned); a ``ValueError`` with the fix when
    llama.cpp could not tokenize as it does (checked before any weights load)."""
    return check_tokenizer_json(serialized(tokenizer, source), source, vocab_size)


def serialized(tokenizer: Any, source: str | Path) -> dict[str, Any]:
    """``tokenizer``'s tokenizers serialization as loaded (``tokenizer.json``'s content); a ``ValueError`` for a
    slow-only tokenizer, which has none."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise ValueError(
            f"--format gguf writes the tokenizer into the file from its tokenizers (fast) form, and the tokenizer of"
            f" {str(source)!r} is a slow-only {type(tokenizer).__name__}. Export --format merged and convert with"
            " llama.cpp's convert_hf_to_gguf.py."
        )
    return json.loads(backend.to_str())


def check_tokenizer_json(tokenizer_json: dict[str, Any], source: str | Path, vocab_size: int) -> str:
    """``check_tokenizer`` on the tokenizers serialization (``tokenizer.json``'s content)."""
    model = tokenizer_json.get("model") or {}
    kind = tokenizer_model(tokenizer_json)
    if kind is None:
        why = {
            "Unigram": "llama.cpp's SentencePiece tokenizer merges pairs by score, which is not the most likely"
            " segmentation a Unigram model picks, so it would split text differently",
            "BPE": "it has no merges to write",
        }.get(model.get("type"), "llama.cpp has no tokenizer of that kind for these architectures")
        raise ValueError(
            f"The tokenizer of {str(source)!r} is a {model.get('type')} model: {why}. --format gguf writes BPE"
            " tokenizers: byte-level (tokenizer.ggml.model = gpt2: Llama 3, Qwen2, SmolLM and the demo's) and"
            " SentencePiece-style with byte fallback (llama: Llama 2, TinyLlama, Mistral 7B). Export --format merged"
            " and convert with llama.cpp's convert_hf_to_gguf.py."
        )
    if kind == "llama":
        check_sentencepiece(tokenizer_json, source)
    elif pre_tokenizer(tokenizer_json) is None:
        known = "; ".join(f"{key}: {what}" for key, what in PRE_TOKENIZERS.items())
        raise ValueError(
            f"The tokenizer of {str(source)!r} splits text with a pre-tokenizer llama.cpp has no name for here"
            f" ({json.dumps(tokenizer_json.get('pre_tokenizer'))[:160]}); known: {known}. With another name"
            " llama.cpp would tokenize differently from the tokenizer the model learned. Export --format merged and"
            " convert with llama.cpp's convert_hf_to_gguf.py, which recognises tokenizers it has seen."
        )
    ids = [token["id"] for token in tokenizer_json.get("added_tokens", [])] + list(model.get("vocab", {}).values())
    largest = max(ids, default=-1)
    if largest >= vocab_size:
        raise ValueError(
            f"The tokenizer of {str(source)!r} has token id {largest}, and the model's embedding has"
            f" vocab_size={vocab_size} rows: that token has no embedding. Use the tokenizer the model was trained"
            " with (--data.tokenizer)."
        )
    return kind


def vocabulary(tokenizer: Any, vocab_size: int, token_types: Any) -> tuple[list[str], list[int]]:
    """The tokens and their types, one per embedding row (``TextModel.get_vocab_base``)."""
    reverse = {index: token for token, index in tokenizer.get_vocab().items()}
    added = tokenizer.get_added_vocab()
    decoder = tokenizer.added_tokens_decoder
    tokens: list[str] = []
    types: list[int] = []
    for index in range(vocab_size):
        if index not in reverse:
            tokens.append(f"[PAD{index}]")
            types.append(token_types.UNUSED)
            continue
        token = reverse[index]
        if token in added:
            if not decoder[index].normalized:
                token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False))
            if decoder[index].special or looks_special(token):
                types.append(token_types.CONTROL)
            else:
                token = user_defined_text(token)
                types.append(token_types.USER_DEFINED)
        else:
            types.append(token_types.NORMAL)
        tokens.append(token)
    return tokens, [int(t) for t in types]


def add_vocabulary(writer: Any, gguf: Any, directory: Path, vocab_size: int) -> dict[str, Any]:
    """Write the tokenizer of ``directory`` into ``writer``; what was written (for the summary and Modelfile)."""
    tokenizer = load_tokenizer(directory)
    tokenizer_json = serialized(tokenizer, directory)
    if check_tokenizer_json(tokenizer_json, directory, vocab_size) == "llama":
        return add_sentencepiece_vocabulary(writer, gguf, directory, tokenizer, tokenizer_json, vocab_size)
    pre = pre_tokenizer(tokenizer_json)
    tokens, types = vocabulary(tokenizer, vocab_size, gguf.TokenType)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    special = special_vocab(gguf, directory, vocab_size, load_merges=True)
    special.add_to_gguf(writer, quiet=True)
    return {
        "model": "gpt2",
        "pre": pre,
        "tokens": len(tokens),
        "merges": len(special.merges),
        "special_ids": dict(special.special_token_ids),
        "add_special": dict(special.add_special_token),
        "chat_template": special.chat_template,
        "token_text": tokens,
    }
