"""A checkpoint written between the micro-batches of an accumulated step, as it would have been written where the
last step ended.

Inside an accumulated step the weights, optimizer, scaler and schedulers are those of the step that ended last; only
the loop has moved on, by the micro-batches of the step so far, whose gradients no checkpoint keeps. Saved as it
stands, the file resumes that step on its remaining micro-batches alone. Saved with the loop and the data position
set back by those micro-batches, and with the random generators as they stood where the last step ended, it resumes
by training them again: the uninterrupted run's step, draw for draw. ``StepBoundaryCheckpoint`` writes the final
step of a run stopped inside a step this way (``max_time``, or a callback's ``trainer.should_stop``).

Only ``ResumableDataLoader`` positions are set back: a loader that keeps its own other state cannot be, and a
loader without state starts its epoch again on resumption whatever the loop says (``unresumable_data.py``).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

import lightning.pytorch as pl

from pl_lowprec.data.resumable import ResumableDataLoader

PROGRESS_COUNTERS = ("ready", "started", "processed", "completed")
AS_AT_THE_STEP_END = "pl_lowprec_as_at_the_step_end"  # a checkpoint's key: written so (not as the run stood)


def micro_batches_into_the_step(trainer: pl.Trainer) -> int:
    """The micro-batches of the current epoch trained since its last optimizer step (0 where one just ended)."""
    done = trainer.fit_loop.epoch_loop.batch_progress.current.processed
    return done % trainer.accumulate_grad_batches


def saved_batch_progress(checkpoint: Mapping[str, Any]) -> Mapping[str, Any]:
    """The fit loop's batch counters in ``checkpoint`` (empty where it holds none)."""
    return checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress", {})


def saved_step_window(checkpoint: Mapping[str, Any], accumulate_grad_batches: int) -> tuple[int, int]:
    """Where ``checkpoint`` stands in the run's optimizer steps, as ``(done, step)``: inside step ``step`` (counted
    from 1: the one taken next) after ``done`` of its micro-batches (0 where a step had just ended)."""
    done = saved_batch_progress(checkpoint).get("current", {}).get("processed", 0) % accumulate_grad_batches
    return done, checkpoint.get("global_step", 0) + 1


def can_set_back(trainer: pl.Trainer) -> bool:
    """Whether the training loaders' positions can be set back: every stateful one is a ``ResumableDataLoader``."""
    combined = trainer.fit_loop._combined_loader
    loaders = combined.flattened if combined is not None else []
    return all(isinstance(loader, ResumableDataLoader) or not hasattr(loader, "state_dict") for loader in loaders)


def set_back(checkpoint: MutableMapping[str, Any], micro_batches: int) -> None:
    """Rewrite, in place, a checkpoint's batch counters and ``ResumableDataLoader`` positions as they stood
    ``micro_batches`` batches earlier."""
    fit_loop = checkpoint["loops"]["fit_loop"]
    batches = fit_loop["epoch_loop.batch_progress"]
    for counters in (batches["total"], batches["current"]):
        for name in PROGRESS_COUNTERS:
            counters[name] -= micro_batches
    for state in fit_loop.get("state_dict", {}).get("combined_loader", []):
        state["batches"] -= micro_batches
