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
