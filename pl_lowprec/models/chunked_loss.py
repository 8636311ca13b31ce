"""Next-token cross-entropy from hidden states, in chunks of the sequence, so the fp32 logits of the whole
batch are never held at once.

Without chunks, the loss keeps ``B * T * vocab`` fp32 logits alive, and cross-entropy saves its fp32
log-softmax of the same size for backward: 2 * 4 * 32000 = 256,000 bytes per token at vocab 32000, or
4.2 GB for a batch of 8 x 2048 tokens. Each chunk here computes its logits and loss under activation
checkpointing: forward keeps only the chunk's input (the hidden states, already alive) and backward
recomputes one chunk's logits at a time, so the peak is ``B * loss_chunk_size * vocab`` fp32 logits twice
(524 MB for 8 x 256 tokens) for one more output-head matmul per chunk in backward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from pl_lowprec.models.cross_entropy import cross_entropy_sum, plain_cross_entropy_sum
from pl_lowprec.models.token_loss import IGNORE_INDEX
from pl_lowprec.transforms.selective_checkpointing import traced_full_checkpoint_args


def _dense_rows(hidden: torch.Tensor) -> torch.Tensor:
    # A chunk is a strided view of the hidden states; its recompute may get a dense copy (activation offloading
    # moves checkpoint inputs to host and back), and matmul takes another path for each, saving tensors of other
    # shapes, which the checkpoint refuses. Dense in both: a chunk-sized temporary. Rows as a 2-D matrix: a 3-D
    # chunk of one sequence is "contiguous" but not foldable, and matmul then runs it as a bmm (18 GFLOP/s in bf16
    # on a CPU, against 289 for the mm of the same rows; benchmarks/dispatch_proxy.py found it).
    return hidden.contiguous().reshape(-1, hidden.size(-1))


def _logits_loss(head: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, grouped: bool = True) -> torch.Tensor:
    loss = cross_entropy_sum if grouped else plain_cross_entropy_sum
    return loss(head(_dense_rows(hidden)), labels.reshape(-1))


def chunk_loss(
    head: nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    recompute: bool = False,
    grouped: bool = True,
    traced: bool = False,
) -> torch.Tensor:
    """Summed cross-entropy of one chunk (output head and loss), the part that ``compile=`` compiles; with
    ``recompute``, under activation checkpointing. The checkpoint is inside, so a compiled ``chunk_loss`` traces it
    (an eager checkpoint around compiled code would recompute through a different graph than its forward).
    ``grouped``: the cross-entropy without fp32 copies of the logits (``cross_entropy.py``), else
    ``F.cross_entropy`` on fp32 logits. ``traced``: compiled, so the recompute is tagged op by op, reaching the ops
    inside the cross-entropy's autograd.Function (``traced_full_checkpoint_args``)."""
    if recompute:
        args = traced_full_checkpoint_args() if traced else {}
        return checkpoint(_logits_loss, head, hidden, labels, grouped, use_reentrant=False, **args)
    return _logits_loss(head, hidden, labels, grouped)


class _FusedCrossEntropyStandIn(torch.autograd.Function):
    """The memory of inductor's compiled ``F.cross_entropy(logits.float())``, for the fake step (its tensors hold
    no numbers): the logits in their own dtype are kept for backward with one fp32 value per row, and the
    gradient is formed in the logits' own buffer; no fp32 copy of the logits exists. Reads and writes the logits
    once each way, as the fused kernels do."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        per_row = logits.amax(dim=-1).float()
        ctx.save_for_backward(logits)
        return per_row.sum()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (logits,) = ctx.saved_tensors
        return logits.mul_(grad.to(logits.dtype)), None


def compiled_chunk_loss_standin(
    head: nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    recompute: bool = False,
    grouped: bool = True,
    traced: bool = False,
) -> torch.Tensor:
    """``chunk_loss`` as ``CausalLM.compile_loss`` compiles it, for ``estimate_memory``'s fake step, where nothing
    compiles. The loss over all positions at once on fp32 logits (``F.cross_entropy``) holds what the compiled
    graph holds (``_FusedCrossEntropyStandIn``): at Llama-3.2-1B shapes, batch 2 x 2048, it predicts 8.26 GiB
    against 8.24 measured on an H100 and 8.25 on an H200 (docs/benchmarks.md runs 2-3, computed after them; 13.12
    as the eager loss). On CPU: +4.1% at a 32,000 vocabulary, 2 blocks of width 256, 512 tokens
    (``tests/memory/test_compiled_loss.py``), +7.6% at width 512 and 1,024 tokens, +9.8% at an 8,000 vocabulary:
    what is left over is the blocks', which compile to a little less there. Chunks under recompute and the
    cross-entropy in row groups run as the eager step runs them: their compiled forms were not measured apart."""
    if recompute or grouped:
        return chunk_loss(head, hidden, labels, recompute, grouped)
    return _FusedCrossEntropyStandIn.apply(head(_dense_rows(hidden)), labels.reshape(-1))


ChunkLoss = Callable[..., torch.Tensor]


def causal_lm_loss_sum(
    head: nn.Module,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int | None = None,
    loss_fn: ChunkLoss = chunk_loss,
    grouped: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed loss of position t predicting ``labels[t + 1]``, and the number of target tokens.

    ``chunk_size=None`` computes the logits of the whole sequence at once; ``loss_fn`` is ``chunk_loss`` or its
    compiled form; ``grouped`` as ``chunk_loss`` takes it.
    """
    hidden, targets = hidden[:, :-1], labels[:, 1:]
    tokens = (targets != IGNORE_INDEX).sum()
    if chunk_size is None:
        return loss_fn(head, hidden, targets, grouped=grouped), tokens
    total = hidden.new_zeros((), dtype=torch.float32)
    starts = range(0, hidden.size(1), chunk_size)
    for start, nothing_to_learn in zip(starts, _chunks_without_targets(targets, chunk_size), strict=True):
        if nothing_to_learn:
            continue  # nothing to learn here: skip the head's matmul entirely
        part = targets[:, start : start + chunk_size]
        total = total + loss_fn(head, hidden[:, start : start + chunk_size], part, recompute=True, grouped=grouped)
    return total, tokens


def _chunks_without_targets(targets: torch.Tensor, chunk_size: int) -> list[bool]:
    """Whether each chunk of positions holds no target token, read with one host sync for all chunks (on a GPU a
    sync per chunk would stop the CPU from queueing the next chunk's kernels while the GPU runs this one's)."""
    ignored = targets == IGNORE_INDEX
    pad = -ignored.size(1) % chunk_size
    chunks = F.pad(ignored, (0, pad), value=True).reshape(ignored.size(0), -1, chunk_size)
    return chunks.all(dim=2).all(dim=0).tolist()
