"""Several samples in one row of ``seq_len`` tokens, with no attention and no label across their boundaries.

A packed row holds whole samples back to back. Its ``position_ids`` restart at 0 for each sample, and the first
label of each sample is -100, so no sample is the target of the one before it. Packed batches carry no
``attention_mask``: from restarting ``position_ids`` and no mask, transformers (``masking_utils``,
``find_packed_sequence_indices``, 5.x) builds a block-causal mask for eager and SDPA attention, and its
flash-attention path turns the same ``position_ids`` into variable-length sequences (``cu_seqlens``). The padding
that ends a row is a segment of its own (positions from 0, labels -100), which no sample attends to.

Prompt/completion and chat samples go into rows by best-fit decreasing: longest first, each into the fullest row
it fits. Equal lengths are ordered by a permutation drawn from ``(seed, epoch)``, so which samples share a row
changes every epoch, while the number of rows (which depends on the lengths alone) does not.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch
from torch.utils.data import Dataset

from pl_lowprec.models.token_loss import IGNORE_INDEX

Row = dict[str, torch.Tensor]


def best_fit_decreasing(lengths: Sequence[int], capacity: int, generator: torch.Generator) -> list[list[int]]:
    """Indices of ``lengths`` grouped into bins of at most ``capacity``; ``generator`` orders equal lengths."""
    tiebreak = torch.randperm(len(lengths), generator=generator).tolist()
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], tiebreak[i]))
    bins: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (space left, bin), sorted: the first that fits is the fullest that fits
    for i in order:
        at = bisect.bisect_left(room, (lengths[i], -1))
        if at == len(room):
            bins.append([i])
            left, index = capacity - lengths[i], len(bins) - 1
        else:
            space, index = room.pop(at)
            bins[index].append(i)
            left = space - lengths[i]
        if left > 0:
            bisect.insort(room, (left, index))
    return bins


def pack_row(samples: Sequence[Row]) -> Row:
    """Samples back to back: ``position_ids`` restart at 0 and the first label of each is -100."""
    labels = [s["labels"].clone() for s in samples]
    for sample_labels in labels:
        sample_labels[0] = IGNORE_INDEX
    return {
        "input_ids": torch.cat([s["input_ids"] for s in samples]),
        "labels": torch.cat(labels),
        "position_ids": torch.cat([torch.arange(len(s["input_ids"])) for s in samples]),
    }


def document_row(block: Sequence[int] | torch.Tensor, document_starts: Sequence[int]) -> Row:
    """A block of concatenated ``text`` records with positions and attention cut where each record starts
    (``document_starts``, offsets in the block; the block's first token starts a segment too).

    Only the records' own boundaries cut: an EOS inside a record (every turn's end in a pre-rendered chat) does not.
    The first token of each record is no target (it would be predicted from the end of the one before).
    """
    ids = torch.as_tensor(block)
    starts = torch.zeros(len(ids), dtype=torch.bool)
    starts[0] = True
    starts[torch.as_tensor(list(document_starts), dtype=torch.long)] = True
    segment = starts.cumsum(0)
    first = torch.nonzero(starts).squeeze(1)
    position_ids = torch.arange(len(ids)) - first[segment - 1]
    labels = ids.clone()
    labels[starts] = IGNORE_INDEX
    return {"input_ids": ids, "labels": labels, "position_ids": position_ids}


class PackedRows(Dataset):
    """Rows of ``seq_len``: ready-made ones (``text`` blocks) first, then the samples packed for each epoch.

    Index ``epoch * len(self) + row`` reads ``row`` of ``epoch``'s packing (``ResumableSampler(epoch_indexed=True)``
    yields such indices), so DataLoader workers need no epoch of their own. Every rank packs the same rows
    before the sampler gives each rank its share, so ranks see disjoint rows.
    """

    def __init__(
        self,
        samples: Sequence[Row],
        seq_len: int,
        seed: int,
        ready: Sequence[Row] = (),
        lengths: Sequence[int] | None = None,
        ready_lengths: Sequence[int] | None = None,
    ) -> None:
        """``lengths`` and ``ready_lengths``: the token counts of ``samples`` and ``ready`` where the caller has them
        without reading the rows (``row_facts.row_lengths``); else each row is read once here."""
        self.samples = samples  # indexed, never copied: a dataset's rows stay in their Arrow table
        self.ready = ready
        self.seq_len = seq_len
        self.seed = seed
        self.lengths = list(lengths) if lengths is not None else [len(s["input_ids"]) for s in self.samples]
        self.ready_lengths = (
            list(ready_lengths) if ready_lengths is not None else [len(r["input_ids"]) for r in self.ready]
        )
        self._epoch, self._bins = 0, self.bins(0)

    def bins(self, epoch: int) -> list[list[int]]:
        """The samples of each packed row in ``epoch``."""
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return best_fit_decreasing(self.lengths, self.seq_len, generator)

    def __len__(self) -> int:
        return len(self.ready) + len(self._bins)

    def __getitem__(self, index: int) -> Row:
        epoch, row = divmod(index, len(self))
        if row < len(self.ready):
            return self.ready[row]
        if epoch != self._epoch:
            self._epoch, self._bins = epoch, self.bins(epoch)
        return pack_row([self.samples[i] for i in self._bins[row - len(self.ready)]])

    def row_lengths(self) -> list[int]:
        return self.ready_lengths + [sum(self.lengths[i] for i in b) for b in self._bins]


def padding_fraction(lengths: Sequence[int], batch_size: int, seed: int) -> float:
    """Share of padding when rows of ``lengths``, in the order of epoch 0, are padded to the longest of a batch."""
    if not lengths:
        return 0.0
    order = torch.randperm(len(lengths), generator=torch.Generator().manual_seed(seed)).tolist()
    padded = 0
    for start in range(0, len(order), batch_size):
        batch = [lengths[i] for i in order[start : start + batch_size]]
        padded += max(batch) * len(batch)
    return 1 - sum(lengths) / padded
