"""Lightning's ``OnExceptionCheckpoint`` under this package's strategies: the same file, but never one that hangs
or one of weights of no step.

Lightning's class saves as any exception reaches the Trainer. On several ranks, where one rank raised alone, that
save waited in its collectives for ranks that trained on into theirs: every rank hung until the process group's
timeout (30 minutes by default). And an exception inside an optimizer's update wrote weights of no step. The
strategies turn Lightning's exact class into this one in place (``replacements.py``): it saves only where every
rank raised at the same batch and no update was interrupted, else says why and which file to resume from
(``exception_guard.py``). Raised after the optimizer stepped, the step is first finished as Lightning would have
finished it (``step_completion.py``, as ``save_on_exception`` does): else the file held step N's weights with the
loop before step N, and a resumption took step N again. The file is otherwise written as the run stood, as
Lightning writes it (resuming from it says what that means, ``strategies/interrupted_batch.py``);
``StepBoundaryCheckpoint(save_on_exception=True)`` writes one that resumes exactly.
"""

from __future__ import annotations

import os

import lightning.pytorch as pl
from lightning.pytorch.callbacks import OnExceptionCheckpoint

from pl_lowprec.callbacks.exception_guard import ExceptionSaveGuard
from pl_lowprec.callbacks.swap import in_place, swap_default_callbacks


class GuardedOnExceptionCheckpoint(ExceptionSaveGuard, OnExceptionCheckpoint):
    """``lightning.pytorch.callbacks.OnExceptionCheckpoint``, same arguments; saves only where every rank raised
    at the same batch and no optimizer update was interrupted."""

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        """Raised after the optimizer stepped, the step is first finished as Lightning would have finished it: the
        file said step N-1 with step N's weights, and a resumption took step N again."""
        with self._one_failure(trainer, pl_module):
            earlier = f" {self.ckpt_path} is an earlier failure's file." if os.path.exists(self.ckpt_path) else ""
            if self._may_save_on_exception(trainer, exception, "OnExceptionCheckpoint", earlier):
                super().on_exception(trainer, pl_module, exception)


def use_guarded_exception_checkpoints(trainer: pl.Trainer) -> None:
    """Turn each of Lightning's own ``OnExceptionCheckpoint`` callbacks (the exact class) into this one, in place."""
    swap_default_callbacks(trainer, {OnExceptionCheckpoint: in_place(GuardedOnExceptionCheckpoint)})
