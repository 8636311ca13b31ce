"""Training bars that make sense for runs limited by ``max_steps``.

Lightning's ``RichProgressBar`` labels the training bar ``Epoch {epoch}/{max_epochs - 1}``. A run limited by
``max_steps`` has ``max_epochs=-1``, so the quick-start read ``Epoch 0/-2``. The rich bar here says
``Epoch 0 (max_steps=200)`` instead, and ``Epoch 0 (max_steps=60, 2 batches a step)`` under accumulation.

Both bars here (rich, and tqdm where ``rich`` is not installed) count batches, as Lightning's do. Lightning 2.6
caps their total at the optimizer steps left, so with ``accumulate_grad_batches=2`` a 60-step run read ``120/60``
(Lightning-AI/pytorch-lightning#20124, PR #21802); here the steps left are counted in batches, from the batch the
epoch resumed at. In manual optimization ``global_step`` counts every optimizer's steps, so two optimizers stepped
each batch end a 60-step run after 30 batches, where a total of 60 left the bar at ``30/60``: there the total starts
from one step per optimizer a batch and follows the steps the epoch's batches really took (a GAN that steps its
generator every other batch gets there after its first two). They are otherwise Lightning's bars. ``pl-lowprec``
and the strategies turn Lightning's own bars into them in place (``use_step_limited_progress_bars``), so the settings
a user gave a bar are kept; pass one in ``callbacks`` to use it with a plain ``Trainer`` and another strategy.
"""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.callbacks.progress.progress_bar import ProgressBar

from pl_lowprec.callbacks.swap import in_place, swap_default_callbacks


class _BatchesToMaxSteps(ProgressBar):
    """The training total as the batch index where ``max_steps`` ends the epoch; placed before Lightning's bar."""

    _epoch_total: int | float | None = None  # set at the epoch's first batch
    _epoch_start: tuple[int, int] | None = None  # (first batch index, global_step) of this epoch's run
    _batches_ended = 0  # the index after the latest batch that ended

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._epoch_total = None
        self._epoch_start = None
        super().on_train_epoch_start(trainer, pl_module)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """The epoch's first batch says where a resumed epoch starts: the bar's total is set from it."""
        if self._epoch_total is None:
            self._epoch_start = (batch_idx, trainer.global_step)
            self._epoch_total = self._batch_index_at_end(first_batch=batch_idx)
            self._show_total(self._epoch_total)
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """In manual optimization the steps a batch takes are known only as they happen: the total follows them."""
        self._batches_ended = batch_idx + 1
        if not pl_module.automatic_optimization and self._epoch_total is not None:
            total = self._batch_index_at_end(first_batch=batch_idx + 1)
            if total != self._epoch_total:
                self._epoch_total = total
                self._show_total(total)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    @property
    def total_train_batches(self) -> int | float:
        # before the epoch's first batch, as if it started at 0: that batch sets the total of a resumed one
        return self._batch_index_at_end(first_batch=0) if self._epoch_total is None else self._epoch_total

    def _batch_index_at_end(self, first_batch: int) -> int | float:
        """The batch index this epoch ends at: its length, or where ``max_steps`` stops it first."""
        trainer = self.trainer
        if trainer.max_steps is None or trainer.max_steps < 0:
            return trainer.num_training_batches
        steps_left = max(trainer.max_steps - trainer.global_step, 0)
        return min(trainer.num_training_batches, first_batch + self._batches_for(steps_left))

    def steps_per_batch(self) -> float:
        """Optimizer steps a batch takes (``global_step`` counts each optimizer's): ``1 / accumulate_grad_batches``
        in automatic optimization; in manual optimization, whatever this epoch's batches stepped so far, and before
        the first one each optimizer once (Lightning's GAN example): two optimizers end a run in half the batches."""
        trainer = self.trainer
        if _automatic(trainer):
            return 1 / trainer.accumulate_grad_batches
        if self._epoch_start is not None:
            first_batch, first_step = self._epoch_start
            batches = self._batches_ended - first_batch
            if batches > 0 and trainer.global_step > first_step:
                return (trainer.global_step - first_step) / batches
        return max(len(trainer.optimizers), 1)

    def _batches_for(self, steps: int) -> int:
        if _automatic(self.trainer):
            return steps * self.trainer.accumulate_grad_batches
        return math.ceil(steps / self.steps_per_batch())

    def _show_total(self, total: int | float) -> None:
        raise NotImplementedError


def _automatic(trainer: pl.Trainer) -> bool:
    """Automatic optimization, also before a module is attached (the label asked for before fit)."""
    module = trainer.lightning_module
    return module is None or module.automatic_optimization


class StepLimitedRichProgressBar(_BatchesToMaxSteps, RichProgressBar):
    """``RichProgressBar`` whose training bar names ``max_steps`` and counts the batches those steps take."""

    def _get_train_description(self, current_epoch: int) -> str:
        max_epochs = self.trainer.max_epochs
        if max_epochs is not None and max_epochs >= 0:
            return super()._get_train_description(current_epoch)
        rate = self.steps_per_batch()  # the bar counts batches; max_steps counts every optimizer's steps
        per_step = f", {1 / rate:g} batches a step" if rate < 1 else f", {rate:g} steps a batch" if rate > 1 else ""
        description = f"Epoch {current_epoch} (max_steps={self.trainer.max_steps}{per_step})"
        return f"{description:{len(self.validation_description)}}"

    def _show_total(self, total: int | float) -> None:
        if self.progress is not None and self.train_progress_bar_id is not None:
            self.progress.update(self.train_progress_bar_id, total=total)


class StepLimitedTQDMProgressBar(_BatchesToMaxSteps, TQDMProgressBar):
    """``TQDMProgressBar`` whose training bar counts the batches ``max_steps`` takes."""

    def _show_total(self, total: int | float) -> None:
        if self._train_progress_bar is not None:
            self.train_progress_bar.total = None if total == float("inf") else total
            self.train_progress_bar.refresh()


def use_step_limited_progress_bars(trainer: pl.Trainer) -> None:
    """Turn Lightning's own bars (its exact classes: its default, or one a user named with settings such as
    ``refresh_rate``; a user's subclass is left as it is) into the step-limited ones, in place."""
    swap_default_callbacks(
        trainer,
        {RichProgressBar: in_place(StepLimitedRichProgressBar), TQDMProgressBar: in_place(StepLimitedTQDMProgressBar)},
    )
