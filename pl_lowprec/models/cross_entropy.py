"""Summed cross-entropy over the logits as the head returns them (bf16 under autocast), without fp32 copies.

``F.cross_entropy(logits.float())`` holds three fp32 tensors of tokens x vocab in backward: the log-softmax it
saved, the NLL gradient and the log-softmax gradient. At Llama-3's vocabulary (128,256) that is 751 MiB for a
chunk of 512 tokens, more than the top block's whole recompute. Here the softmax is computed in fp32 a few rows
at a time, in forward for the log-sum-exp and in backward for ``softmax - one_hot``, written straight into a
gradient in the logits' dtype: a chunk costs its logits and their gradient, nothing of vocabulary size in fp32
beyond a few rows. Liger's and torchtune's fused cross-entropies do the same. The numbers are those of
``F.cross_entropy`` on the fp32 logits (both compute in fp32), up to the order of fp32 operations.
"""

from __future__ import annotations

from typing import Any

import torch

from pl_lowprec.models.token_loss import IGNORE_INDEX

ROW_ELEMENTS = 1 << 24  # fp32 temporaries of one group of rows: 64 MiB


def cross_entropy_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``F.cross_entropy(logits.float(), targets, ignore_index=IGNORE_INDEX, reduction="sum")`` for 2-D logits."""
    return _CrossEntropySum.apply(logits, targets)


def _row_groups(rows: int, vocab: int) -> list[slice]:
    step = max(1, ROW_ELEMENTS // max(vocab, 1))
    return [slice(i, min(i + step, rows)) for i in range(0, rows, step)]


def _logsumexp(logits: torch.Tensor) -> torch.Tensor:
    """``torch.logsumexp(logits.float(), -1)`` by its own steps, in place on the one fp32 copy (the op itself
    makes a second one, ``x - max``, which a dispatch mode does not see)."""
    x = logits.to(torch.float32, copy=True)
    maxes = x.amax(dim=-1, keepdim=True)
    maxes.masked_fill_(maxes.abs() == float("inf"), 0.0)
    return x.sub_(maxes).exp_().sum(dim=-1).log_().add_(maxes.squeeze(-1))


class _CrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        valid = targets != IGNORE_INDEX
        safe = torch.where(valid, targets, 0)
        lse = torch.empty(logits.shape[0], dtype=torch.float32, device=logits.device)
        for rows in _row_groups(*logits.shape):
            lse[rows] = _logsumexp(logits[rows])
        picked = logits.gather(1, safe[:, None]).squeeze(1).float()
        ctx.save_for_backward(logits, safe, valid, lse)
        return ((lse - picked) * valid).sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, safe, valid, lse = ctx.saved_tensors
        scale = valid.float() * grad.float()
        grad_logits = torch.empty_like(logits)
        for rows in _row_groups(*logits.shape):
            part = logits[rows].to(torch.float32, copy=True).sub_(lse[rows, None]).exp_()  # softmax
            part.scatter_add_(1, safe[rows, None], part.new_full((part.shape[0], 1), -1.0))
            grad_logits[rows] = part.mul_(scale[rows, None])
        return grad_logits, None
