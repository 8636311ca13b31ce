"""The two reasons a checkpoint callback must not write its file on an exception, shared by this package's
``StepBoundaryCheckpoint(save_on_exception=True)`` and the strategies' ``OnExceptionCheckpoint``.

An exception that interrupted an optimizer's update leaves weights of no step (``interrupted_update.py``): a file
of them would be resumed as exact. And with several ranks, a rank that raised alone would hang in the save's
collectives (``distributed/failing_ranks.py``). Either way no file is written, and a paragraph says what happened
and which file to resume from.

The guards of one trainer share one ``TrainerGuard``: one watch of its optimizers (one set of hooks, one closure
wrapped per step, however many guards), and one answer of the other ranks per failure (asked once: a second ask
would wait for them again). That answer and the failed step belong to one failure: Lightning calls every
callback's ``on_exception`` in turn, so the trainer's first guard to be called forgets an earlier failure's answer,
and its last forgets this one's. A trainer that failed before and fails again before its callbacks' ``setup`` (in
``prepare_data``, a datamodule's ``setup``) took the earlier failure's answer: on several ranks, "every rank raised"
saved where another rank trained on (a hang in the save's collectives); on one, "inside the update" wrote no file.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from weakref import WeakKeyDictionary

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn

from pl_lowprec.callbacks.interrupted_update import UpdateWatch
from pl_lowprec.callbacks.step_completion import finish_the_step
from pl_lowprec.distributed.failing_ranks import (
    RanksAtFailure,
    every_rank_wait_s,
    interrupted_update_paragraph,
    ranks_at_failure,
    ranks_not_failed_paragraph,
)


@dataclass
class TrainerGuard:
    """What a trainer's guards share: the watch of the current fit's optimizers and the current failure's answer
    from the ranks (``None`` until a guard asks; forgotten where a run or a batch starts, and once the guards
    handled the failure: ``ExceptionSaveGuard._one_failure``)."""

    watch: UpdateWatch = field(default_factory=UpdateWatch)
    ranks: RanksAtFailure | None = None

    def clear(self) -> None:
        """A batch or a run starts: no step of it, no failure yet."""
        self.watch.new_batch()
        self.ranks = None


_guards: WeakKeyDictionary[pl.Trainer, TrainerGuard] = WeakKeyDictionary()


def trainer_guard(trainer: pl.Trainer) -> TrainerGuard:
    """The trainer's ``TrainerGuard``; a new one where none is yet (a failure before the fit's training)."""
    guard = _guards.get(trainer)  # not setdefault: it would build a TrainerGuard at every batch to drop it
    if guard is None:
        guard = _guards[trainer] = TrainerGuard()
    return guard


def _start_fits_guard(trainer: pl.Trainer) -> None:
    """A new ``TrainerGuard`` for the fit's training, noting where each of Lightning's steps ends; an earlier fit's
    torch hooks removed (a failed fit has no ``teardown``)."""
    earlier = _guards.get(trainer)
    if earlier is not None:
        earlier.watch.release()
    guard = _guards[trainer] = TrainerGuard()
    guard.watch.follow_steps(trainer)


class ExceptionSaveGuard(Callback):
    """A mixin before a checkpoint callback's class: ``_may_save_on_exception`` before its exception save. Its
    state lives in class defaults and the trainer's ``TrainerGuard``: a callback may become this class in place
    (no ``__init__``)."""

    every_rank_wait_s: float | None = None  # how long a failing rank waits for the others; None: derived

    @property
    def _saves_on_exception(self) -> bool:
        """Whether this callback writes a file on an exception (``StepBoundaryCheckpoint``: ``save_on_exception``)."""
        return True

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """A run starts: an earlier run's step and failure are not its own. (The strategies turn a callback into a
        guard after this hook: in its first fit, ``on_train_start`` starts anew.)"""
        super().setup(trainer, pl_module, stage)
        trainer_guard(trainer).clear()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The trainer's first guard starts the fit's ``TrainerGuard``; the optimizers get torch's step hooks once,
        where a guard saves on an exception."""
        super().on_train_start(trainer, pl_module)
        if self is next(iter(_guards_of(trainer)), self):
            _start_fits_guard(trainer)
        if self._saves_on_exception:
            trainer_guard(trainer).watch.follow_updates(trainer)

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)
        trainer_guard(trainer).clear()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().teardown(trainer, pl_module, stage)
        trainer_guard(trainer).watch.release()

    @contextmanager
    def _one_failure(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> Iterator[None]:
        """Around a guard's ``on_exception``: the failure's answer and step are this failure's alone. The first guard
        called forgets an earlier failure's answer (where a guard's ``on_exception`` raised, the last was not
        called); the last forgets this one's answer and step, whatever it did. Inside, a step the optimizer took
        before the exception is finished first (``_finish_a_stepped_batch``)."""
        guards = _guards_of(trainer)
        guard = trainer_guard(trainer)
        if guards and self is guards[0]:
            guard.ranks = None
        try:
            self._finish_a_stepped_batch(trainer, pl_module)
            yield
        finally:
            if guards and self is guards[-1]:
                guard.clear()

    def _finish_a_stepped_batch(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Raised after the optimizer stepped and before Lightning counted the step: the step finished as Lightning
        would have finished it (``step_completion.py``), so that a file written now holds the step's weights with
        the step counted. Once per failure whichever guard comes first: the later ones find nothing to do."""
        fitting_automatically = trainer.state.fn == TrainerFn.FITTING and pl_module.automatic_optimization
        if trainer_guard(trainer).watch.stepped and fitting_automatically:
            finish_the_step(trainer)

    def _may_save_on_exception(self, trainer: pl.Trainer, exception: BaseException, who: str, note: str = "") -> bool:
        """Whether the exception's file may be written: no rank's update interrupted, and every rank raised at
        this batch; else a paragraph (``who``: the callback, ``note`` last) saying why not and which file to resume
        from. The ranks are asked once per failure: a second guard takes the first one's answer."""
        guard = trainer_guard(trainer)
        if guard.ranks is None:  # the longest wait any guard was given: the ranks are asked once for all of them
            given = [callback.every_rank_wait_s for callback in _guards_of(trainer)]
            wait_s = every_rank_wait_s(trainer, max((s for s in given if s is not None), default=None))
            guard.ranks = ranks_at_failure(trainer, exception, guard.watch.interrupted, wait_s)
        ranks = guard.ranks
        last_file = last_saved_file(trainer)
        if ranks.interrupted_updates:
            said = interrupted_update_paragraph(trainer, exception, ranks.interrupted_updates, last_file, who)
        elif not ranks.every_rank_failed:
            said = ranks_not_failed_paragraph(trainer, exception, last_file, ranks.wait_s, who)
        else:
            return True
        warnings.warn(said + note, stacklevel=1)
        return False


def _guards_of(trainer: pl.Trainer) -> list[ExceptionSaveGuard]:
    """The trainer's guards, in the order Lightning calls them."""
    return [callback for callback in trainer.callbacks if isinstance(callback, ExceptionSaveGuard)]


def last_saved_file(trainer: pl.Trainer) -> str:
    """The latest file the trainer's ``ModelCheckpoint`` callbacks wrote in this run ("" if none)."""
    files = [
        callback._last_checkpoint_saved or callback.last_model_path
        for callback in trainer.checkpoint_callbacks
        if isinstance(callback, ModelCheckpoint)
    ]
    return max((file for file in files if file), key=_modified, default="")


def _modified(file: str) -> float:
    try:
        return os.path.getmtime(file)
    except OSError:
        return 0.0
