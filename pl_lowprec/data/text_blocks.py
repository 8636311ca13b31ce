"""``text`` records joined into one stream and read as blocks of ``seq_len`` tokens, each block knowing where in it
a record starts.

An EOS token does not mark where a record ends: a pre-rendered chat has its tokenizer's EOS at every turn's end
(ChatML's ``<|im_end|>``, Llama-3's ``<|eot_id|>``), and ``encode_text`` ends each record with one. So the block
does not look for EOS tokens: the records' lengths say where each starts, and packing (``packing.document_row``)
cuts positions and attention there and nowhere else, as TRL's packing restarts ``position_ids`` per example.

The blocks are cut when read, from the records' lengths, so that the records are split into training and
validation before any block is cut (``record_split``). The records stay where they are: a list in memory for a
``.txt``/``.jsonl`` file, an Arrow table for a dataset (``token_table.TableDocuments``).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from itertools import accumulate, pairwise
from typing import Protocol

import torch
from torch.utils.data import Dataset

from pl_lowprec.data.packing import document_row

Row = dict[str, torch.Tensor]


class Documents(Protocol):
    """``text`` records as token ids (each ending with its EOS), in order."""

    def __len__(self) -> int: ...

    def lengths(self) -> list[int]:
        """Each record's token count."""
        ...

    def tokens(self, index: int, start: int, stop: int) -> torch.Tensor:
        """Tokens ``start:stop`` of record ``index``."""
        ...

    def select(self, indices: Sequence[int]) -> Documents:
        """The records at ``indices``, in that order."""
        ...


class DocumentList:
    """The ``text`` records of a ``.txt``/``.jsonl`` file, held in memory."""

    def __init__(self, documents: Sequence[torch.Tensor]) -> None:
        self.documents = list(documents)

    def __len__(self) -> int:
        return len(self.documents)

    def lengths(self) -> list[int]:
        return [len(d) for d in self.documents]

    def tokens(self, index: int, start: int, stop: int) -> torch.Tensor:
        return self.documents[index][start:stop]

    def select(self, indices: Sequence[int]) -> DocumentList:
        return DocumentList([self.documents[i] for i in indices])


class TextBlocks(Dataset):
    """The records of ``documents`` back to back, cut into blocks of ``seq_len``; the last, shorter block is kept
    when it has at least 2 tokens (one target). Unpacked, a block is ``input_ids`` and ``labels`` (every token);
    under ``packing`` it is a ready row whose positions and attention restart where each record starts."""

    def __init__(self, documents: Documents, seq_len: int, packing: bool) -> None:
        self.documents = documents
        self.seq_len = seq_len
        self.packing = packing
        self.ends = list(accumulate(documents.lengths()))  # record i spans [ends[i - 1], ends[i]) of the stream
        total = self.ends[-1] if self.ends else 0
        self.full, rest = divmod(total, seq_len)
        self.rest = rest if rest >= 2 else 0

    def __len__(self) -> int:
        return self.full + (self.rest > 0)

    def lengths(self) -> list[int]:
        """Each block's token count, without reading a token."""
        return [self.seq_len] * self.full + ([self.rest] if self.rest else [])

    def ready(self) -> list[bool]:
        """Whether each block is a row that packing leaves as it is: all of them under packing."""
        return [self.packing] * len(self)

    def __getitem__(self, index: int) -> Row:
        if not 0 <= index < len(self):
            raise IndexError(f"block {index} of {len(self)}")
        start = index * self.seq_len
        stop = min(start + self.seq_len, self.ends[-1])
        pieces, starts = [], []
        record = bisect.bisect_right(self.ends, start)  # the record holding the block's first token
        begin = self.ends[record - 1] if record else 0
        while begin < stop:
            end = self.ends[record]
            if begin >= start:
                starts.append(begin - start)
            pieces.append(self.documents.tokens(record, max(start, begin) - begin, min(stop, end) - begin))
            record, begin = record + 1, end
        ids = torch.cat(pieces).long()
        if self.packing:
            return document_row(ids, starts)
        return {"input_ids": ids, "labels": ids.clone()}

    def records_cut(self) -> int:
        """How many records that would fit one block lie across two blocks: the second part of each trains
        without the first (a rendered chat's answer without its question)."""
        return sum(
            e - s <= self.seq_len and s // self.seq_len != (e - 1) // self.seq_len
            for s, e in pairwise([0, *self.ends])  # each record's [start, end) in the stream
        )
