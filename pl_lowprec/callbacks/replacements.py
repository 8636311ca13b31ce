"""The Lightning callbacks this package replaces wherever it runs (``pl-lowprec`` and the strategies' ``setup``):
the model summary, which counts a 4-bit weight as half its parameters, and ``ModelCheckpoint``, which saves
between accumulated micro-batches and can miss the final step (changed in place). The progress bar is swapped by
``pl-lowprec`` alone (``cli/lightning_cli.py``): Lightning calls the callbacks' ``setup`` before the strategy's, so
a new bar put in there would miss its own (``ProgressBar.setup`` gives it the trainer)."""

from __future__ import annotations

import lightning.pytorch as pl

from pl_lowprec.callbacks.model_summary import use_true_size_model_summary
from pl_lowprec.callbacks.step_boundary_checkpoint import use_step_boundary_checkpoints


def use_package_callbacks(trainer: pl.Trainer) -> None:
    """Lightning's summary and checkpoint callbacks (their exact classes) replaced by this package's."""
    use_true_size_model_summary(trainer)
    use_step_boundary_checkpoints(trainer)
