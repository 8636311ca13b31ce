"""The measured peak of one training step through Lightning's own ``fit`` loop, for the estimate to be checked
against: PyTorch's profiler allocation records from before the module is built, so every storage the run makes
(weights, gradients, optimizer state, batches, activations) is counted from its allocation to its free; the
measured peak is the highest running total over the last optimizer step's window (all its micro-batches and the
optimizer step), the last step's gradients and the optimizer state included. Frees of storages made before the
profiler started are not recorded, which is why the module is built inside it.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning_helpers import quiet_trainer
from torch.profiler import ProfilerActivity, profile

from pl_lowprec.memory.profiled import peak_in_window

WINDOW = "measured_window"


class LastStepWindow(pl.Callback):
    """A profiler range over optimizer step ``step`` (0-based): from its first micro-batch's start to the end of its
    last micro-batch (which holds the optimizer step)."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.range: Any = None

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        window = trainer.accumulate_grad_batches
        if batch_idx == self.step * window:
            self.range = torch.autograd.profiler.record_function(WINDOW)
            self.range.__enter__()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        window = trainer.accumulate_grad_batches
        if batch_idx == (self.step + 1) * window - 1 and self.range is not None:
            self.range.__exit__(None, None, None)
            self.range = None


def measured_fit_peak(
    build: Callable[[], pl.LightningModule], loader: Any, steps: int = 3, optimizers: int = 1, **trainer: Any
) -> int:
    """The profiler's peak of live CPU tensor bytes over the last of ``steps`` optimizer steps of
    ``Trainer.fit(build(), loader)`` (``trainer``: the Trainer's arguments, ``quiet_trainer``'s defaults). A manual
    ``training_step`` stepping ``optimizers`` optimizers: Lightning counts each one's step in ``max_steps``."""
    gc.collect()  # garbage of earlier tests is not freed inside the window
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as prof:
        torch.manual_seed(0)
        module = build()
        callbacks = [*trainer.pop("callbacks", []), LastStepWindow(steps - 1)]
        quiet_trainer(max_steps=steps * optimizers, callbacks=callbacks, **trainer).fit(module, loader)
    return peak_in_window(prof, WINDOW)


def ids_loader(batches: int, rows: int, seq: int, vocab: int = 256) -> torch.utils.data.DataLoader:
    """``batches`` batches of ``rows`` x ``seq`` random token ids below ``vocab`` (seeded: the same every call), as
    ``{"input_ids": ...}`` rows."""
    ids = torch.randint(0, vocab, (batches * rows, seq), generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader([{"input_ids": row} for row in ids], batch_size=rows)
