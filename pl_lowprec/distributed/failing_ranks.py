"""Whether every rank failed at the same batch, asked before a checkpoint is saved on an exception.

A checkpoint is written by every rank together: the package's strategies gather each rank's random states, and
Lightning's ``Trainer.save_checkpoint`` ends in a barrier (FSDP gathers the shards too). Where one rank raises
alone, the others go on training into their next collective, and the failing rank's save waits in its own for
them: both hang until the process group's timeout (30 minutes by default), without a word. So before saving, each
failing rank says so in the process group's key-value store (no collective: it answers beside a rank stuck in one)
and waits a while for every rank to say the same of the same batch. Lightning's ``OnExceptionCheckpoint`` has the
same hang; its own hook is left as it is.
"""

from __future__ import annotations

import contextlib
import itertools
from datetime import timedelta
from typing import Any

import torch.distributed as dist

# How long a failing rank waits for the others to fail at the same batch: they run the same code on the same
# batch, so an exception every rank raises (a bug, a Ctrl-C that reaches every rank) arrives within a step's time.
EVERY_RANK_WAIT_S = 60.0

_failures = itertools.count()  # this process's exceptions asked about: every rank counts the same ones


def every_rank_failed_here(trainer: Any) -> bool:
    """Whether every rank of the process group raised at this rank's place in the run (its epoch, batch and
    global step): ``True`` at once with one process; else after up to ``EVERY_RANK_WAIT_S`` seconds."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return True
    progress = trainer.fit_loop.epoch_loop.batch_progress.total
    place = f"pl_lowprec_failed/{next(_failures)}/{trainer.current_epoch}/{progress.ready}/{trainer.global_step}"
    store = dist.distributed_c10d._get_default_store()
    keys = [f"{place}/{rank}" for rank in range(dist.get_world_size())]
    try:
        store.set(keys[dist.get_rank()], "1")
        store.wait(keys, timedelta(seconds=EVERY_RANK_WAIT_S))
        return not store.check([f"{place}/gave_up"])
    except RuntimeError:  # DistStoreError: a rank did not say so in time; DistNetworkError: rank 0's store is gone
        with contextlib.suppress(RuntimeError):
            store.set(f"{place}/gave_up", "1")  # a rank that says so later must not save with this one gone
        return False


def ranks_not_failed_paragraph(trainer: Any, exception: BaseException, last_file: str) -> str:
    """The message of a failing rank that saves no checkpoint because the other ranks did not fail with it."""
    return (
        f"save_on_exception: rank {dist.get_rank()} raised {type(exception).__name__} at batch"
        f" {trainer.fit_loop.epoch_loop.batch_idx} of epoch {trainer.current_epoch} (global step"
        f" {trainer.global_step}), and not every one of the {dist.get_world_size()} ranks raised there within"
        f" {EVERY_RANK_WAIT_S:.0f} s. A checkpoint is written by every rank together, so none is saved (the save"
        " would wait for the others until the process group's timeout). The run's last checkpoint stays"
        f" {last_file or 'the last one saved (none yet)'}; resume from it."
    )
