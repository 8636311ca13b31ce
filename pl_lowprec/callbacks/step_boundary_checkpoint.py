"""Lightning's ``ModelCheckpoint`` that saves where an optimizer step ends, and saves the run's final step.

Lightning 2.6's ``every_n_train_steps`` tests ``global_step`` after every batch. With ``accumulate_grad_batches``
above 1, a run resumed from a checkpoint on that grid saves the same step again after its first micro-batch
(Lightning-AI/pytorch-lightning#17903): that file holds a half-accumulated step whose gradients no checkpoint
keeps, so a resumption from it drops them, and in the same directory it replaces the file the run resumed from.
And a run whose ``max_steps`` is off the grid (60 steps, every 20: fine; 50 steps: not) ends without saving its
last steps: ``last.ckpt`` holds step 40, and ``pl-lowprec export`` of it exports the adapters of 10 steps before
the end without a word. Hugging Face's ``Trainer`` saves at the end for the same reason (transformers#30160).

A validation can run between the micro-batches of a step (an integer ``val_check_interval`` that is no multiple of
``accumulate_grad_batches``), and Lightning saves at its end (the epoch schedule, or a step save that waited for
the monitored metric): that file too lacks the gradients of the window's first micro-batches.

And where ``max_steps`` stops a run inside an epoch, Lightning saves (an epoch schedule: its default) at the epoch's
end, in a state that counts the epoch as complete: a resumption skips the rest of the epoch's batches.

``StepBoundaryCheckpoint`` saves only on a batch that stepped the optimizer, and saves the run's final step on its
last batch, where it resumes exactly: off a step or time schedule's grid, and inside an epoch (the latest
``save_top_k`` files without a monitor; ``last.ckpt`` where ``save_last``; a monitored top-k is not ranked on a
stale metric, and a monitored epoch schedule is Lightning's). A validation's save without a monitor that falls inside
a step is made where the step ends. A run stopped inside a step (``max_time``, ``EarlyStopping`` or a callback's
``trainer.should_stop``) saves its final step at once, and a monitored validation save inside a step is made at
once (the file holds the weights its metric scored): both written as at the last step's end
(``step_end_rewind.py``), so that a resumption trains the step's micro-batches again; so is a ``save_on_exception``
file (the exception's batch, whose random draws it leaves out, is trained again too). It keeps Lightning's state
key, so checkpoints resume across the two classes. ``pl-lowprec`` and the strategies turn Lightning's own
``ModelCheckpoint`` callbacks (that exact class: the same objects, arguments and state) into this one; its own name
keeps ``--trainer.callbacks+=ModelCheckpoint`` meaning Lightning's on the command line.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.types import STEP_OUTPUT

from pl_lowprec.callbacks.epoch_end_resumption import as_saved_at_the_last_batch
from pl_lowprec.callbacks.exception_guard import ExceptionSaveGuard
from pl_lowprec.callbacks.step_end_rewind import (
    AS_AT_THE_STEP_END,
    can_set_back,
    micro_batches_into_the_step,
    saved_batch_progress,
    saved_step_window,
    set_back,
)
from pl_lowprec.callbacks.swap import in_place, swap_default_callbacks
from pl_lowprec.generator_states import generators_held, random_states


class StepBoundaryCheckpoint(ExceptionSaveGuard, LightningModelCheckpoint):
    """``lightning.pytorch.callbacks.ModelCheckpoint``, same arguments: never saves in the middle of an
    accumulated step, and saves the run's final step that ``every_n_train_steps`` or ``train_time_interval``
    would miss.

    One more: ``every_rank_wait_s``, with ``save_on_exception`` on several ranks, how long a failing rank waits for
    every rank to fail at the same batch before it saves nothing and says so (a rank that raised alone would hang
    in the save's collectives). Default: 60 s, or the process group's ``timeout`` where shorter
    (``distributed/failing_ranks.py``)."""

    _global_step_at_batch_start: int | None = None
    _validation_save_pending: bool = False  # a validation ended inside a step: its save waits for the step's end
    _step_end_random_states: dict[str, Any] | None = None  # where the latest step ended (``step_end_rewind.py``)
    _step_end_global_step: int | None = None  # that step's global_step
    _micro_batches_to_set_back: int | None = None  # set while this callback writes a file as at the last step's end

    def __init__(self, *args: Any, every_rank_wait_s: float | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.every_rank_wait_s = every_rank_wait_s

    @property
    def _saves_on_exception(self) -> bool:
        return self.save_on_exception

    def _generate_state_key(self, **kwargs: Any) -> str:
        return f"{LightningModelCheckpoint.__qualname__}{kwargs!r}"  # Lightning's key: either class resumes the other

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """A checkpoint saved at a training epoch's end resumes exactly under ``max_steps`` on any strategy
        (``epoch_end_resumption.py``); Lightning restores the loops from this dict after the callbacks."""
        super().on_load_checkpoint(trainer, pl_module, checkpoint)
        if trainer.state.fn == TrainerFn.FITTING:
            as_saved_at_the_last_batch(checkpoint, trainer.max_steps)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Where a fit begins, before anything of it can fail: an earlier fit's step end is none of this one's."""
        super().setup(trainer, pl_module, stage)
        if stage == TrainerFn.FITTING:
            self._step_end_random_states = self._step_end_global_step = None
            self._validation_save_pending = False

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Inside an accumulated step, an unmonitored save waits for the step's end: a file saved here would lack
        the gradients of the step's micro-batches so far, and a resumption from it would take the step without
        them."""
        if not (pl_module.automatic_optimization and inside_an_accumulated_step(trainer)):
            super().on_validation_end(trainer, pl_module)
        elif self.monitor is None and not trainer.should_stop:
            self._validation_save_pending = True
        else:
            with self._as_at_the_last_step_end(trainer):
                super().on_validation_end(trainer, pl_module)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """``save_on_exception``: the file is written as at the last step's end. As it stands, it holds the loop
        inside a step (the micro-batches so far counted, their gradients in no file: the step resumed on the rest
        alone) and the random generators after the failed batch's draws (its retry draws other dropout masks).
        Raised after the optimizer stepped, the step is first finished as Lightning would have finished it
        (``step_completion.py``). No file where the exception interrupted the optimizer's update (weights of no
        step), nor with several ranks unless every rank raised at the same batch (the save's collectives would wait
        for a rank that trains on): ``exception_guard.py``."""
        with self._one_failure(trainer, pl_module):
            if not self._should_save_on_exception(trainer):
                return
            if not self._may_save_on_exception(trainer, exception, "save_on_exception"):
                return
            with self._as_at_the_last_step_end(trainer):
                super().on_exception(trainer, pl_module, exception)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        self._global_step_at_batch_start = trainer.global_step

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: STEP_OUTPUT, batch: Any, batch_idx: int
    ) -> None:
        if not pl_module.automatic_optimization:  # a manual loop steps as it likes
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
            return
        if trainer.global_step == self._global_step_at_batch_start:  # a micro-batch of an accumulated step
            if trainer.should_stop and not self._should_skip_saving_checkpoint(trainer) and self._can_set_back(trainer):
                with self._as_at_the_last_step_end(trainer):
                    self._save_final_step(trainer)
            return
        self._step_end_random_states, self._step_end_global_step = random_states(), trainer.global_step
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if self._validation_save_pending:
            self._validation_save_pending = False
            super().on_validation_end(trainer, pl_module)
        if run_ends_after_this_batch(trainer) and not self._should_skip_saving_checkpoint(trainer):
            self._save_final_step(trainer)

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        super().on_save_checkpoint(trainer, pl_module, checkpoint)
        if self._micro_batches_to_set_back is not None:
            checkpoint[AS_AT_THE_STEP_END] = True
            set_back(checkpoint, self._micro_batches_to_set_back)

    def _can_set_back(self, trainer: pl.Trainer) -> bool:
        """Whether a file saved now can be written as at the last step's end: while fitting, a step ended in this
        epoch, its random states were kept (not so where an exception ended the step's batch before this callback's
        ``on_train_batch_end``: the generators stand at that step's end then; nor under manual optimization, whose
        steps this callback does not follow), and the training loaders' positions can be set back."""
        if trainer.state.fn != TrainerFn.FITTING or self._step_end_global_step != trainer.global_step:
            return False  # the random states are kept and cleared together with their global_step
        into_the_step = micro_batches_into_the_step(trainer)
        ended_in_this_epoch = trainer.fit_loop.epoch_loop.batch_progress.current.processed > into_the_step
        return ended_in_this_epoch and can_set_back(trainer)

    @contextmanager
    def _as_at_the_last_step_end(self, trainer: pl.Trainer) -> Iterator[None]:
        """Saves in the block are written as at the last step's end where they can be (else as they stand)."""
        if not self._can_set_back(trainer):
            yield
            return
        self._micro_batches_to_set_back = micro_batches_into_the_step(trainer)
        try:
            with generators_held(self._step_end_random_states):
                yield
        finally:
            self._micro_batches_to_set_back = None

    def _save_final_step(self, trainer: pl.Trainer) -> None:
        """The final step, where Lightning would not save it (a step or time schedule off its grid) or would save
        it at the epoch's end although the run stopped inside the epoch (``max_steps``, ``max_time``): Lightning
        then counts the epoch as complete, and a resumption starts the next one, skipping the rest of this one."""
        by_steps = self._every_n_train_steps >= 1 or self._train_time_interval is not None
        inside_epoch = not trainer.fit_loop.epoch_loop._num_ready_batches_reached()
        if not by_steps and (self.monitor is not None or not inside_epoch):
            return  # Lightning's own save at the epoch's end or validation: exact there, or ranked by its metric
        candidates = self._monitor_candidates(trainer)
        if self.monitor is None:  # the latest k; a monitored top-k would rank the end on a stale metric
            self._save_topk_checkpoint(trainer, candidates)
        self._save_last_checkpoint(trainer, candidates)


def inside_an_accumulated_step(trainer: pl.Trainer) -> bool:
    """Whether the fit loop stands between the micro-batches of an optimizer step (at a validation inside the
    epoch: the batch just trained did not step)."""
    if trainer.state.fn != TrainerFn.FITTING or trainer.sanity_checking:
        return False
    return trainer.fit_loop.epoch_loop._should_accumulate()


def run_ends_after_this_batch(trainer: pl.Trainer) -> bool:
    """``max_steps`` reached, the last epoch's last batch, or a stop already asked for (``max_time``)."""
    if trainer.should_stop or 0 <= trainer.max_steps <= trainer.global_step:
        return True
    last_epoch = trainer.max_epochs is not None and 0 <= trainer.max_epochs <= trainer.current_epoch + 1
    return last_epoch and trainer.fit_loop.epoch_loop._num_ready_batches_reached()


def use_step_boundary_checkpoints(trainer: pl.Trainer) -> None:
    """Turn each of Lightning's own ``ModelCheckpoint`` callbacks (the exact class; a user's subclass is left as
    it is) into this package's, in place: the object a user holds stays the one the Trainer calls."""
    swap_default_callbacks(trainer, {LightningModelCheckpoint: in_place(StepBoundaryCheckpoint)})


def mid_step_resumption(checkpoint: Mapping[str, Any], accumulate_grad_batches: int) -> str | None:
    """A warning's text where ``checkpoint`` was saved between the micro-batches of an accumulated step (as
    Lightning's class does on a resumed run's first batch); ``None`` where it was saved where a step ended."""
    done, step = saved_step_window(checkpoint, accumulate_grad_batches)
    if not done or saved_batch_progress(checkpoint).get("is_last_batch", False):
        return None
    return (
        f"This checkpoint was saved after {done} of the {accumulate_grad_batches} micro-batches of optimizer step"
        f" {step} (Lightning's ModelCheckpoint saves such a file on the first batch of a run resumed with"
        " accumulate_grad_batches > 1, Lightning-AI/pytorch-lightning#17903). It holds no gradients, so step"
        f" {step} is taken on the remaining {accumulate_grad_batches - done} micro-batches alone, not as an"
        " uninterrupted run takes it. For an exact resumption, resume from a checkpoint saved where a step ended;"
        " pl_lowprec.callbacks.StepBoundaryCheckpoint saves only there."
    )
