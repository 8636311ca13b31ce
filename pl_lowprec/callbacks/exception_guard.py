"""The two reasons a checkpoint callback must not write its file on an exception, shared by this package's
``StepBoundaryCheckpoint(save_on_exception=True)`` and the strategies' ``OnExceptionCheckpoint``.

An exception that interrupted an optimizer's update leaves weights of no step (``interrupted_update.py``): a file
of them would be resumed as exact. And with several ranks, a rank that raised alone would hang in the save's
collectives (``distributed/failing_ranks.py``). Either way no file is written, and a paragraph says what happened
and which file to resume from.
"""

from __future__ import annotations

import os
import warnings
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from pl_lowprec.callbacks.interrupted_update import UpdateWatch
from pl_lowprec.distributed.failing_ranks import (
    every_rank_wait_s,
    interrupted_update_paragraph,
    ranks_at_failure,
    ranks_not_failed_paragraph,
)


class ExceptionSaveGuard(Callback):
    """A mixin before a checkpoint callback's class: ``_may_save_on_exception`` before its exception save. Its
    state lives in class defaults and ``on_train_start``: a callback may become this class in place (no
    ``__init__``)."""

    every_rank_wait_s: float | None = None  # how long a failing rank waits for the others; None: derived
    _update_watch: UpdateWatch | None = None

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        if self._update_watch is None:
            self._update_watch = UpdateWatch()
        self._update_watch.follow(trainer)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        if self._update_watch is not None:
            self._update_watch.new_batch()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().teardown(trainer, pl_module, stage)
        if self._update_watch is not None:
            self._update_watch.release()

    @property
    def _optimizer_stepped(self) -> bool:
        """The current batch's optimizer step finished (an exception after it: ``step_completion.py``)."""
        return self._update_watch is not None and self._update_watch.stepped

    def _may_save_on_exception(self, trainer: pl.Trainer, exception: BaseException, who: str, note: str = "") -> bool:
        """Whether the exception's file may be written: no rank's update interrupted, and every rank raised at
        this batch; else a paragraph (``who``: the callback, ``note`` last) saying why not and which file to resume
        from."""
        interrupted = self._update_watch is not None and self._update_watch.interrupted
        wait_s = every_rank_wait_s(trainer, self.every_rank_wait_s)
        ranks = ranks_at_failure(trainer, exception, interrupted, wait_s)
        last_file = last_saved_file(trainer)
        if ranks.interrupted_updates:
            said = interrupted_update_paragraph(trainer, exception, ranks.interrupted_updates, last_file, who)
        elif not ranks.every_rank_failed:
            said = ranks_not_failed_paragraph(trainer, exception, last_file, ranks.wait_s, who)
        else:
            return True
        warnings.warn(said + note, stacklevel=1)
        return False


def last_saved_file(trainer: pl.Trainer) -> str:
    """The latest file the trainer's ``ModelCheckpoint`` callbacks wrote in this run ("" if none)."""
    files = [
        getattr(callback, "_last_checkpoint_saved", "") or callback.last_model_path
        for callback in trainer.checkpoint_callbacks
        if isinstance(callback, ModelCheckpoint)
    ]
    return max((file for file in files if file), key=_modified, default="")


def _modified(file: str) -> float:
    try:
        return os.path.getmtime(file)
    except OSError:
        return 0.0
