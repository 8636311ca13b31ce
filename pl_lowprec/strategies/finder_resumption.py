"""Lightning's tuner callbacks refused in a fit that resumes from a checkpoint.

``LearningRateFinder`` and ``BatchSizeFinder`` save the model in ``on_fit_start``, run their trial steps and
restore that file through the checkpoint connector, whose ``resume_end`` drops the checkpoint the fit is resuming
from. Where the model is restored before ``on_fit_start`` (the package's strategies, Lightning's own single-device
and DDP ones), the fit then keeps the checkpoint's weights but loses its step count, optimizer moments,
schedulers and loop position: it trains again from step 0, silently (``restore_training_state`` finds nothing to
restore).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import BatchSizeFinder, LearningRateFinder

from pl_lowprec.strategies.trainer_checks import first_callback

FINDERS = (LearningRateFinder, BatchSizeFinder)


def check_no_finder_when_resuming(trainer: Any) -> None:
    """``ValueError`` (one paragraph) where a fit resuming from a checkpoint has a tuner callback."""
    finder = first_callback(trainer, FINDERS)
    if finder is None:
        return
    name = type(finder).__name__
    raise ValueError(
        f"fit(ckpt_path={str(trainer.ckpt_path)!r}) resumes a run, and Trainer(callbacks=[{name}(...)]) would undo"
        " that: the callback saves the model in on_fit_start, runs its trial steps and restores its own file,"
        " which drops the checkpoint being resumed, so the run would keep the checkpoint's weights but start again"
        " at step 0 with fresh optimizer moments, schedulers and loop position. Resume without the callback, giving"
        " the module the learning rate or batch size the first run found, or tune before the first fit with"
        " Tuner(trainer).lr_find(model) / .scale_batch_size(model)."
    )
