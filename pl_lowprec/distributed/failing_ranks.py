"""Whether every rank failed at the same batch, and whether an optimizer update was interrupted on any, asked
before a checkpoint is saved on an exception.

A checkpoint is written by every rank together: the package's strategies gather each rank's random states, and
Lightning's ``Trainer.save_checkpoint`` ends in a barrier (FSDP gathers the shards too). Where one rank raises
alone, the others go on training into their next collective, and the failing rank's save waits in its own for
them: both hang until the process group's timeout (30 minutes by default), without a word. So before saving, each
failing rank says so in the process group's key-value store (no collective: it answers beside a rank stuck in one),
with whether the exception interrupted its optimizer's update (``callbacks/interrupted_update.py``), and waits a
while for every rank to say the same of the same batch. Every rank then reads the same answers, so they all save
or none does.

How long: ranks that run the same code on the same batch raise an exception they share (a bug, a Ctrl-C that
reaches every rank) within the time the slowest is behind, at most about a step's, since the gradients' all-reduce
lines them up every step. ``DEFAULT_WAIT_S`` (60 s) is a guess above that for most runs, and only delays the
message of a rank that raised alone; a wait too short saves nothing (and says so), never a wrong file. A process
group whose timeout is shorter caps it: a rank of that group waits no longer in a collective either. A run whose
steps take longer sets ``StepBoundaryCheckpoint(every_rank_wait_s=...)``.
"""

from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from pl_lowprec.distributed.several_ranks import several_ranks

DEFAULT_WAIT_S = 60.0  # how long a failing rank waits for the others to fail at the same batch, unless set

_failures = itertools.count()  # this process's exceptions asked about: every rank counts the same ones


@dataclass(frozen=True)
class RanksAtFailure:
    every_rank_failed: bool  # at this rank's place in the run, within the wait
    interrupted_updates: tuple[int, ...]  # the ranks whose exception interrupted an optimizer update
    wait_s: float


def every_rank_wait_s(trainer: Any, given: float | None = None) -> float:
    """``given``, else ``DEFAULT_WAIT_S`` capped at the strategy's process-group ``timeout``."""
    if given is not None:
        return float(given)
    timeout = getattr(trainer.strategy, "_timeout", None)
    return min(DEFAULT_WAIT_S, timeout.total_seconds()) if isinstance(timeout, timedelta) else DEFAULT_WAIT_S


def ranks_at_failure(trainer: Any, exception: BaseException, update_interrupted: bool, wait_s: float) -> RanksAtFailure:
    """Whether every rank of the process group raised at this rank's place in the run (its epoch, batch and global
    step), and which of them had an optimizer update interrupted: at once with one process; else after up to
    ``wait_s`` seconds. Once per failure (each call waits for the others' answers again): the callbacks share the
    answer (``callbacks/exception_guard.py``)."""
    if not several_ranks():
        return RanksAtFailure(True, (0,) if update_interrupted else (), 0.0)
    progress = trainer.fit_loop.epoch_loop.batch_progress.total
    place = f"{trainer.current_epoch}/{progress.ready}/{trainer.global_step}"
    return _ask_the_store(f"pl_lowprec_failed/{next(_failures)}/{place}", update_interrupted, wait_s)


def _ask_the_store(place: str, update_interrupted: bool, wait_s: float) -> RanksAtFailure:
    store = dist.distributed_c10d._get_default_store()
    keys = [f"{place}/{rank}" for rank in range(dist.get_world_size())]
    try:
        store.set(keys[dist.get_rank()], "interrupted" if update_interrupted else "whole")
        store.wait(keys, timedelta(seconds=wait_s))
        interrupted = tuple(rank for rank, key in enumerate(keys) if store.get(key) == b"interrupted")
        return RanksAtFailure(not store.check([f"{place}/gave_up"]), interrupted, wait_s)
    except RuntimeError:  # DistStoreError: a rank did not say so in time; DistNetworkError: rank 0's store is gone
        with contextlib.suppress(RuntimeError):
            store.set(f"{place}/gave_up", "1")  # a rank that says so later must not save with this one gone
        return RanksAtFailure(False, (dist.get_rank(),) if update_interrupted else (), wait_s)


def _where(trainer: Any) -> str:
    return (
        f"batch {trainer.fit_loop.epoch_loop.batch_idx} of epoch {trainer.current_epoch} (global step"
        f" {trainer.global_step})"
    )


def _resume_from(last_file: str) -> str:
    return f"The run's last checkpoint stays {last_file or 'the last one saved (none yet)'}; resume from it."


def ranks_not_failed_paragraph(
    trainer: Any, exception: BaseException, last_file: str, wait_s: float, who: str = "save_on_exception"
) -> str:
    """The message of a failing rank that saves no checkpoint because the other ranks did not fail with it."""
    return (
        f"{who}: rank {dist.get_rank()} raised {type(exception).__name__} at {_where(trainer)}, and not every one"
        f" of the {dist.get_world_size()} ranks raised there within {wait_s:g} s. A checkpoint is written by every"
        " rank together, so none is saved (the save would wait for the others until the process group's timeout;"
        " StepBoundaryCheckpoint(every_rank_wait_s=...) sets how long a failing rank waits for the others)."
        f" {_resume_from(last_file)}"
    )


def interrupted_update_paragraph(
    trainer: Any, exception: BaseException, ranks: tuple[int, ...], last_file: str, who: str = "save_on_exception"
) -> str:
    """The message where an exception came inside an optimizer's update, so that no file is written."""
    on = ""
    if several_ranks():
        on = f" on rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"
    return (
        f"{who}: {type(exception).__name__} was raised inside the optimizer's step{on}, after it had begun"
        f" updating the parameters, at {_where(trainer)}: some parameters and optimizer states may hold the new"
        " step and the others the old one, so the weights are those of no step. No checkpoint is written for this"
        f" exception (it would be resumed as if exact). {_resume_from(last_file)} It retrains the steps since."
    )
