"""An exception raised after the optimizer stepped, before Lightning counted the step: the step finished as
Lightning would have finished it.

Lightning 2.6 steps the optimizer inside the module's ``optimizer_step`` hook, and only after that hook returns does
it count the step (``global_step``) and the batch (``processed``) and step the step-interval schedulers (at an
epoch's last batch the epoch-interval ones too), all before ``on_train_batch_end``. An exception in between, raised by
a module's own ``optimizer_step`` after it called ``optimizer.step`` or by a ``KeyboardInterrupt``, leaves the
weights, the optimizer and the loss scaler at the new step and the rest behind. A file saved then says step N-1 and
holds step N's weights: a resumption takes step N again, with the scheduler one step behind from there on.

``finish_the_step`` does the rest of that bookkeeping, so that the run stands where the step's batch ended (the
state ``on_train_batch_end`` saves, which resumes exactly). The exception guards (``StepBoundaryCheckpoint`` and the
strategies' ``OnExceptionCheckpoint``) call it before they save, and learn that the optimizer stepped from
Lightning's own after-step slot of each ``LightningOptimizer`` (the one its manual loop counts steps with), which
runs once the strategy's step, the scaler's update included, has returned.
"""

from __future__ import annotations

from collections.abc import Callable

import lightning.pytorch as pl


def on_each_optimizer_step(trainer: pl.Trainer, note: Callable[[], None]) -> None:
    """Call ``note`` after each step of the training's optimizers (after what was called there already)."""
    for optimizer in trainer.strategy._lightning_optimizers:
        called_before = optimizer._on_after_step

        def after_step(called_before: Callable[[], None] = called_before) -> None:
            called_before()
            note()

        optimizer._on_after_step = after_step


def finish_the_step(trainer: pl.Trainer) -> None:
    """Count the optimizer step and its batch and step the schedulers, where an exception stopped Lightning after the
    optimizer stepped (automatic optimization) and before it did so."""
    epoch_loop = trainer.fit_loop.epoch_loop
    step = epoch_loop.automatic_optimization.optim_progress.optimizer.step
    if step.current.ready > step.current.completed:
        step.increment_completed()
    batches = epoch_loop.batch_progress
    if batches.current.processed < batches.current.started:
        batches.increment_processed()
        epoch_loop.update_lr_schedulers("step", update_plateau_schedulers=False)
        if epoch_loop._num_ready_batches_reached():
            epoch_loop.update_lr_schedulers("epoch", update_plateau_schedulers=False)
