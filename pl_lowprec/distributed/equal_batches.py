"""Every rank's training loader gives the same number of batches per epoch, checked before the first step.

Why: every optimizer step all-reduces across the ranks, so they must run the same steps. Lightning's own
``DistributedSampler`` pads the ranks to equal lengths; a user's per-rank loader (``use_distributed_sampler=False``)
need not. Then the rank that runs out first ends its fit as if all went well while the others wait on it: measured
on 2 gloo ranks (7 and 6 batches), rank 1 finished silently after 6 steps and rank 0 stopped in gloo's
"Connection closed by peer" traceback (NCCL hangs until the process-group timeout). One all-gather of each rank's
count, at the start of fit, turns that into one message on every rank.
"""

from __future__ import annotations

from typing import Any

import torch

from pl_lowprec.distributed.gather import gather_from_ranks


def check_equal_batches(trainer: Any) -> None:
    """``ValueError`` on every rank when the ranks' training loaders differ in length and the run would reach the
    end of the shortest (a ``max_steps`` that ends the first epoch before it is left alone)."""
    strategy = trainer.strategy
    if strategy.world_size < 2:
        return
    count = torch.tensor([float(trainer.num_training_batches)], dtype=torch.float64, device=strategy.root_device)
    counts = gather_from_ranks(count).flatten().tolist()
    if len(set(counts)) == 1:
        return
    needed = trainer.max_steps * trainer.accumulate_grad_batches
    if trainer.max_steps >= 0 and trainer.current_epoch == 0 and needed <= min(counts):
        return  # every rank stops at max_steps inside its first epoch: the same steps everywhere
    listed = ", ".join(f"rank {rank}: {int(c) if c != float('inf') else 'no length'}" for rank, c in enumerate(counts))
    raise ValueError(
        f"The ranks' training loaders give different numbers of batches per epoch ({listed}). Every optimizer step"
        " all-reduces across the ranks, so the rank that runs out first would end its fit while the others wait on it"
        " (a silent early finish there, a 'Connection closed by peer' or a hang on the others). Fix: give every rank"
        " the same number of batches, e.g. Lightning's own sampler (use_distributed_sampler=True, the default), or"
        " DistributedSampler(..., drop_last=True) in your loader, or Trainer(limit_train_batches="
        f"{int(min(counts))})."
    )
