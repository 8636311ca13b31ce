"""Pad a list of samples into the Hugging Face batch: ``input_ids``, ``attention_mask``, ``labels`` (-100: no loss)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pl_lowprec.models.token_loss import IGNORE_INDEX


class PadCollate:
    """Right-pads to the longest sample of the batch (a class, not a closure, so workers can pickle it)."""

    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id

    def __call__(self, samples: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        longest = max(len(s["input_ids"]) for s in samples)
        ids = torch.full((len(samples), longest), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(samples), longest), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(samples), longest), dtype=torch.long)
        for row, sample in enumerate(samples):
            n = len(sample["input_ids"])
            ids[row, :n] = sample["input_ids"]
            labels[row, :n] = sample["labels"]
            mask[row, :n] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class PackedCollate:
    """Packed rows (``pl_lowprec.data.packing``) right-padded to the longest, with ``position_ids`` and no
    ``attention_mask``: its absence is what makes transformers build the block-causal mask from the positions.

    The padding is a segment of its own (positions from 0, labels -100), so no sample attends to it.
    """

    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id

    def __call__(self, rows: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        longest = max(len(r["input_ids"]) for r in rows)
        ids = torch.full((len(rows), longest), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(rows), longest), IGNORE_INDEX, dtype=torch.long)
        positions = torch.arange(longest).repeat(len(rows), 1)
        for i, row in enumerate(rows):
            n = len(row["input_ids"])
            ids[i, :n] = row["input_ids"]
            labels[i, :n] = row["labels"]
            positions[i, :n] = row["position_ids"]
            positions[i, n:] = torch.arange(longest - n)
        return {"input_ids": ids, "labels": labels, "position_ids": positions}
