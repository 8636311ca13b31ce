"""A SentencePiece-style tokenizer shaped like Mistral-7B-v0.3's, built offline with ``tokenizers`` (no download, no
sentencepiece package), saved as the ``LlamaTokenizerFast`` directory a hub model has.

Shaped as the hub's ``tokenizer.json`` files converted from a SentencePiece BPE model are: ``<unk>``, ``<s>``,
``</s>`` and Mistral's control tokens first (special added tokens, also in the BPE vocabulary), the 256 ``<0xNN>``
byte-fallback tokens, runs of spaces, the learned pieces in merge order, the characters last. The merges are every
split of a token into two tokens, ranked by the score of the token they make (transformers'
``SentencePieceExtractor``), the runs of spaces last as their -1e9 scores put them. Spaces become ``▁``
(``Metaspace``: one prepended, the text kept whole); BOS is added. The pieces are learned on the standard library's
sources (ASCII only, so other text needs the byte fallback); ``<think>`` is a plain (user-defined) added token; the
chat template wraps turns in Mistral's control tokens.
"""

from __future__ import annotations

from pathlib import Path

CONTROL = [
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[TOOL_CALLS]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
]
USER_DEFINED = "<think>"
BYTES = [f"<0x{b:02X}>" for b in range(256)]
# Runs of spaces: right after the bytes by id, as in Mistral's and Llama 2's vocabularies, yet scored last
# (-1e9 there), so their merges rank after every other: a token's id is not its score.
WHITESPACE = ["\u2581" * n for n in (2, 3, 4, 8)]
MISTRAL_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '[SYSTEM_PROMPT]' + message['content'] + '[/SYSTEM_PROMPT]' }}"
    "{% elif message['role'] == 'user' %}{{ '[INST]' + message['content'] + '[/INST]' }}"
    "{% else %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)


def learned_pieces(text: str, pieces: int) -> list[str]:
    """Pieces learned by BPE on ``text`` split at spaces (as SentencePiece trains), merged ones in merge order."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    trainer = trainers.BpeTrainer(vocab_size=pieces, show_progress=False)
    tokenizer.train_from_iterator([text], trainer=trainer)
    by_id = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    tokens = [token for token, _ in by_id if token.replace("\u2581", "").isascii()]
    return [t for t in tokens if len(t) > 1] + [t for t in tokens if len(t) == 1]


def sentencepiece_merges(vocab: dict[str, int], by_score: list[str]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens, by the token's place in ``by_score`` (best first), then by the
    pieces' ids, as transformers' ``SentencePieceExtractor`` lists a SentencePiece BPE model's merges."""
    merges = []
    for rank, token in enumerate(by_score):
        splits = [(token[:cut], token[cut:]) for cut in range(1, len(token))]
        found = [(vocab[a], vocab[b], a, b) for a, b in splits if a in vocab and b in vocab]
        merges += [(rank, left_id, right_id, (a, b)) for left_id, right_id, a, b in found]
    return [pair for *_, pair in sorted(merges)]


def save_sentencepiece_tokenizer(directory: Path, pieces: int = 420, text_bytes: int = 150_000) -> Path:
    """The tokenizer, saved to ``directory`` (about ``len(CONTROL) + 256 + 4 + pieces + 1`` tokens)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import LlamaTokenizerFast

    from pl_lowprec.demo.stdlib_text import stdlib_bytes

    text = stdlib_bytes(text_bytes).decode("utf-8", "replace")
    learned = [piece for piece in learned_pieces(text, pieces) if piece not in WHITESPACE]
    vocab = {token: index for index, token in enumerate([*CONTROL, *BYTES, *WHITESPACE, *learned])}
    merged, characters = [p for p in learned if len(p) > 1], [p for p in learned if len(p) == 1]
    merges = sentencepiece_merges(vocab, [*CONTROL, *BYTES, *merged, *WHITESPACE, *characters])
    bpe = models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    tokenizer = Tokenizer(bpe)
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in CONTROL])
    tokenizer.add_tokens([AddedToken(USER_DEFINED, special=False, normalized=False)])
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    wrapped = LlamaTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        add_bos_token=True,
        add_eos_token=False,
        chat_template=MISTRAL_CHAT_TEMPLATE,
    )
    wrapped.save_pretrained(directory)
    return directory
