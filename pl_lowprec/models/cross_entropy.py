"""Summed cross-entropy over half-precision logits as the head returns them under autocast, without fp32 copies.

``F.cross_entropy(logits.float())`` holds three fp32 tensors of tokens x vocab in backward: the log-softmax it
saved, the NLL gradient and the log-softmax gradient. At Llama-3's vocabulary (128,256) that is 751 MiB for a
chunk of 512 tokens, more than the top block's whole recompute. Here the softmax is computed in fp32 a few rows
at a time, in forward for the log-sum-exp and in backward for ``softmax - one_hot``, written straight into a
gradient in the logits' dtype: a chunk costs its logits and their gradient, nothing of vocabulary size in fp32
beyond a few rows. Liger's and torchtune's fused cross-entropies do the same. The numbers are those of
``F.cross_entropy`` on the fp32 logits: the same log-softmax kernel in fp32, and its gradient formed as ATen's
log-softmax backward forms it.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from pl_lowprec.models.token_loss import IGNORE_INDEX

ROW_ELEMENTS = 1 << 23  # a group of rows: its fp32 copy and log-softmax, 32 MiB each


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")`` for 2-D logits.
    fp32 logits (32-true) take ``F.cross_entropy`` itself: there is no copy to avoid, and its numbers stay the
    reference's bit for bit."""
    if logits.dtype == torch.float32:
        return F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    return _CrossEntropySum.apply(logits, targets)


def plain_cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")`` itself, as Hugging
    Face's loss computes it: one fused kernel each way, and the fp32 copies above (``memory_saving`` without
    ``grouped_cross_entropy``)."""
    return F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")


def _row_groups(rows: int, vocab: int) -> list[slice]:
    step = max(1, ROW_ELEMENTS // max(vocab, 1))
    return [slice(i, min(i + step, rows)) for i in range(0, rows, step)]


def _log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """ATen's log-softmax in fp32, row by row, as ``F.cross_entropy(logits.float())`` computes it (each row on its
    own, so the numbers do not depend on how many rows a group or a rank holds)."""
    return torch.log_softmax(logits, dim=-1, dtype=torch.float32)


class _CrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        valid = targets != IGNORE_INDEX
        safe = torch.where(valid, targets, 0)
        picked = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        for rows in _row_groups(*logits.shape):
            picked[rows] = _log_softmax(logits[rows]).gather(1, safe[rows, None]).squeeze(1)
        ctx.save_for_backward(logits, safe, valid)
        return -(picked * valid).sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, safe, valid = ctx.saved_tensors
        scale = valid.float() * grad.float()
        grad_logits = torch.empty_like(logits)
        for rows in _row_groups(*logits.shape):
            part = _log_softmax(logits[rows]).exp_().mul_(scale[rows, None])  # softmax x g
            part.scatter_add_(1, safe[rows, None], -scale[rows, None])  # minus g at the target
            grad_logits[rows] = part
        return grad_logits, None
