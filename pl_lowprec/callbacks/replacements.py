"""The Lightning callbacks this package replaces wherever it runs (``pl-lowprec`` and the strategies' ``setup``):
the model summary, which counts a 4-bit weight as half its parameters; ``ModelCheckpoint``, which saves between
accumulated micro-batches and can miss the final step; ``OnExceptionCheckpoint``, which hangs every rank where one
raised alone; and the progress bars, which read ``Epoch 0/-2`` under ``max_steps``. The last three change class in
place: Lightning calls the callbacks' ``setup`` before the strategy's,
and the objects keep what it gave them (a bar's trainer) and what the user set."""

from __future__ import annotations

import lightning.pytorch as pl

from pl_lowprec.callbacks.model_summary import use_true_size_model_summary
from pl_lowprec.callbacks.on_exception_checkpoint import use_guarded_exception_checkpoints
from pl_lowprec.callbacks.progress import use_step_limited_progress_bars
from pl_lowprec.callbacks.step_boundary_checkpoint import use_step_boundary_checkpoints


def use_package_callbacks(trainer: pl.Trainer) -> None:
    """Lightning's summary, checkpoint and progress-bar callbacks (their exact classes) replaced by this
    package's."""
    use_true_size_model_summary(trainer)
    use_step_boundary_checkpoints(trainer)
    use_guarded_exception_checkpoints(trainer)
    use_step_limited_progress_bars(trainer)
