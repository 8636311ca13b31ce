"""Pad a list of samples into the Hugging Face batch: ``input_ids``, ``attention_mask``, ``labels`` (-100: no loss)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pl_lowprec.models.token_loss import IGNORE_INDEX


def right_padded(
    samples: Sequence[dict[str, torch.Tensor]], pad_token_id: int
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """``input_ids`` and ``labels`` of ``samples`` right-padded to the longest (labels with -100), and the lengths."""
    lengths = [len(s["input_ids"]) for s in samples]
    ids = torch.full((len(samples), max(lengths)), pad_token_id, dtype=torch.long)
    labels = torch.full((len(samples), max(lengths)), IGNORE_INDEX, dtype=torch.long)
    for row, (sample, n) in enumerate(zip(samples, lengths, strict=True)):
        ids[row, :n] = sample["input_ids"]
        labels[row, :n] = sample["labels"]
    return ids, labels, lengths


class PadCollate:
    """Right-pads to the longest sample of the batch (a class, not a closure, so workers can pickle it)."""

    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id

    def __call__(self, samples: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        ids, labels, lengths = right_padded(samples, self.pad_token_id)
        mask = (torch.arange(ids.shape[1]) < torch.tensor(lengths)[:, None]).long()
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


class PackedCollate:
    """Packed rows (``pl_lowprec.data.packing``) right-padded to the longest, with ``position_ids`` and no
    ``attention_mask``: its absence is what makes transformers build the block-causal mask from the positions.

    The padding is a segment of its own (positions from 0, labels -100), so no sample attends to it.
    """

    def __init__(self, pad_token_id: int) -> None:
        self.pad_token_id = pad_token_id

    def __call__(self, rows: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        ids, labels, lengths = right_padded(rows, self.pad_token_id)
        positions = torch.arange(ids.shape[1]).repeat(len(rows), 1)
        for i, (row, n) in enumerate(zip(rows, lengths, strict=True)):
            positions[i, :n] = row["position_ids"]
            positions[i, n:] = torch.arange(ids.shape[1] - n)
        return {"input_ids": ids, "labels": labels, "position_ids": positions}
