"""llama.cpp's SentencePiece tokenizer (``LLAMA_VOCAB_TYPE_SPM``, src/llama-vocab.cpp) ported to Python, reading
a GGUF's metadata: what llama-cli and Ollama would feed the model and print back, which no binary here can show.

Ported from ``llama_vocab::impl``: ``load`` (defaults for a ``llama`` vocabulary: BOS added, space prefix on),
``tokenizer_st_partition`` (special, user-defined and unknown tokens matched whole, longest first; control and
unknown ones only when ``parse_special``), ``tokenize`` (a space before each text fragment that starts the text or
follows a token, spaces escaped to ``▁``), ``llm_tokenizer_spm_session`` (merge the adjacent pair whose text is the
token of highest score, leftmost on ties; spell what is left with ``<0xNN>`` byte tokens), ``token_to_piece`` and
``detokenize`` (byte tokens decode to their byte, control ones to nothing unless asked).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


@dataclass
class LlamaCppSpm:
    tokens: list[str]
    scores: list[float]
    types: list[int]
    bos_id: int = 1
    eos_id: int = 2
    add_bos: bool = True
    add_space_prefix: bool = True

    @classmethod
    def from_fields(cls, fields: dict) -> LlamaCppSpm:
        """From ``GGUFReader`` fields (``{name: field.contents()}``), with llama.cpp's defaults for missing keys."""
        assert fields["tokenizer.ggml.model"] == "llama"
        return cls(
            tokens=list(fields["tokenizer.ggml.tokens"]),
            scores=list(fields["tokenizer.ggml.scores"]),
            types=list(fields["tokenizer.ggml.token_type"]),
            bos_id=fields.get("tokenizer.ggml.bos_token_id", 1),
            eos_id=fields.get("tokenizer.ggml.eos_token_id", 2),
            add_bos=fields.get("tokenizer.ggml.add_bos_token", True),
            add_space_prefix=fields.get("tokenizer.ggml.add_space_prefix", True),
        )

    def __post_init__(self) -> None:
        self.token_to_id = {token: index for index, token in enumerate(self.tokens)}
        assert len(self.token_to_id) == len(self.tokens), "llama.cpp refuses a repeated token"
        specials = [i for i, kind in enumerate(self.types) if kind in (CONTROL, USER_DEFINED, UNKNOWN)]
        self.specials = sorted(specials, key=lambda i: -len(self.tokens[i].encode()))

    def partition(self, text: str, parse_special: bool) -> list[str | int]:
        fragments: list[str | int] = [text]
        for special in self.specials:
            if not parse_special and self.types[special] in (CONTROL, UNKNOWN):
                continue
            piece = self.tokens[special]
            split: list[str | int] = []
            for fragment in fragments:
                if not isinstance(fragment, str):
                    split.append(fragment)
                    continue
                parts = fragment.split(piece)
                for i, part in enumerate(parts):
                    if i:
                        split.append(special)
                    if part:
                        split.append(part)
            fragments = split
        return fragments

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        output = [self.bos_id] if add_special and self.add_bos else []
        previous_special = True
        for fragment in self.partition(text, parse_special) if text else []:
            if isinstance(fragment, int):
                output.append(fragment)
                previous_special = True
                continue
            prefix = " " if self.add_space_prefix and previous_special else ""
            output += self.spm_session((prefix + fragment).replace(" ", "\u2581"))
            previous_special = False
        return output

    def spm_session(self, text: str) -> list[int]:
        symbols = list(text)  # UTF-8 characters
        following = [*range(1, len(symbols)), -1]
        preceding = list(range(-1, len(symbols) - 1))
        queue: list[tuple[float, int, int, int]] = []

        def try_add_bigram(left: int, right: int) -> None:
            if left == -1 or right == -1:
                return
            joined = symbols[left] + symbols[right]
            token = self.token_to_id.get(joined)
            if token is not None:  # highest score first, then leftmost
                heapq.heappush(queue, (-self.scores[token], left, right, len(joined)))

        for i in range(1, len(symbols)):
            try_add_bigram(i - 1, i)
        while queue:
            _, left, right, size = heapq.heappop(queue)
            if not symbols[left] or not symbols[right] or len(symbols[left]) + len(symbols[right]) != size:
                continue
            symbols[left], symbols[right] = symbols[left] + symbols[right], ""
            following[left] = following[right]
            if following[right] >= 0:
                preceding[following[right]] = left
            try_add_bigram(preceding[left], left)
            try_add_bigram(left, following[left])
        output: list[int] = []
        i = 0 if symbols else -1
        while i != -1:  # resegment: a merged symbol is always a token; an unmerged one may need its bytes
            token = self.token_to_id.get(symbols[i])
            if token is not None:
                output.append(token)
            else:
                output += [self.token_to_id[f"<0x{byte:02X}>"] for byte in symbols[i].encode()]
            i = following[i]
        return output

    def token_to_piece(self, token: int, lstrip: bool, special: bool) -> bytes:
        kind, text = self.types[token], self.tokens[token]
        if kind in (CONTROL, UNKNOWN) and not special:
            return b""
        if kind in (CONTROL, UNKNOWN, USER_DEFINED):
            piece = text.encode()
        elif kind == NORMAL:
            piece = text.replace("\u2581", " ").encode()
        elif kind == BYTE:
            piece = bytes([int(text[3:5], 16)])
        else:
            return b""
        return piece[1:] if lstrip and piece.startswith(b" ") else piece

    def detokenize(self, ids: list[int], remove_special: bool = True, unparse_special: bool = False) -> str:
        remove_space = self.add_space_prefix
        if remove_special and self.add_bos and ids[:1] == [self.bos_id]:
            remove_space, ids = False, ids[1:]
        out = b""
        for token in ids:
            out += self.token_to_piece(token, remove_space, unparse_special)
            remove_space = False
        return out.decode("utf-8", "replace")
