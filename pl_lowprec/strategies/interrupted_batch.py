"""A checkpoint written as an exception interrupted a training batch, with the run's state as it stood.

Lightning's ``OnExceptionCheckpoint`` and a ``ModelCheckpoint`` subclass with ``save_on_exception`` (the strategies
turn only Lightning's exact class into ``StepBoundaryCheckpoint``) write the failed run as it stands: the loop
counts the failed batch as not processed, so a resumption trains it again, but the random generators stand after
that batch's first try (its dropout masks drawn), so the retry and every later draw differ from an uninterrupted
run's; inside an accumulated step, the step's earlier micro-batches are counted without their gradients too. The
strategies note such a file as they write it (``CHECKPOINT_KEY``: the failed batch) and say so on resumption.
``StepBoundaryCheckpoint`` writes its exception file as at the last step's end instead (``AS_AT_THE_STEP_END``),
which resumes exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus

from pl_lowprec.callbacks.step_end_rewind import AS_AT_THE_STEP_END, saved_step_window

CHECKPOINT_KEY = "pl_lowprec_interrupted_batch"


def interrupted_batch(trainer: Any, checkpoint: Mapping[str, Any]) -> int | None:
    """The epoch's index of the training batch an exception interrupted, where ``checkpoint`` is written now with
    the state as it stands (started, not processed); else ``None``."""
    if trainer.state.status != TrainerStatus.INTERRUPTED or trainer.state.fn != TrainerFn.FITTING:
        return None
    if checkpoint.get(AS_AT_THE_STEP_END) or trainer.sanity_checking or trainer.validating:
        return None
    progress = trainer.fit_loop.epoch_loop.batch_progress.current
    return progress.ready - 1 if progress.ready > progress.processed else None


def interrupted_batch_paragraph(checkpoint: Mapping[str, Any], accumulate_grad_batches: int) -> str | None:
    """The warning's text for resuming from such a file; ``None`` for any other."""
    batch = checkpoint.get(CHECKPOINT_KEY)
    if batch is None:
        return None
    done, step = saved_step_window(checkpoint, accumulate_grad_batches)  # the loop stands before the failed batch
    lacking = (
        f" It was inside optimizer step {step}, after {done} of its {accumulate_grad_batches} micro-batches, whose"
        " gradients no file holds: the step is taken without them."
        if done
        else ""
    )
    return (
        f"This checkpoint was written as an exception interrupted training batch {batch} of epoch"
        f" {checkpoint.get('epoch', 0)}, with the run's state as it stood (Lightning's OnExceptionCheckpoint, or a"
        " ModelCheckpoint subclass with save_on_exception). The resumption trains that batch again, but the random"
        " generators stand after its first try, so its dropout masks and every later random draw differ from an"
        f" uninterrupted run's.{lacking} For an exact resumption, resume from a checkpoint saved where a step ended;"
        " pl_lowprec.callbacks.StepBoundaryCheckpoint(save_on_exception=True) writes its exception file that way."
    )
