"""One optimizer step on fake tensors, as Lightning's loop runs it, under a ``StepTracker``.

The loop is the one Lightning's automatic optimization runs, written out: for each micro-batch of the window
``training_step`` (under the precision's autocast) and ``backward``; then ``on_before_optimizer_step``, the
optimizer step and ``zero_grad(set_to_none=True)``. No Trainer is built: the module sees a ``DryRunTrainer``
that answers what training steps ask (accumulation, world size, a reduce that returns its input), and
``self.log`` does nothing.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pl_lowprec.memory.tracker import StepTracker


@dataclass
class _DryRunStrategy:
    transform: Any
    world_size: int = 1

    def reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return tensor  # every rank sees the same batch shapes


@dataclass
class DryRunTrainer:
    """What a ``LightningModule`` reads from its trainer during ``configure_model`` and a training step."""

    transform: Any
    accumulate_grad_batches: int = 1
    world_size: int = 1
    lightning_module: Any = None
    strategy: _DryRunStrategy = field(init=False)
    datamodule: Any = None
    estimated_stepping_batches: int = 1
    global_rank: int = 0
    local_rank: int = 0
    barebones: bool = True  # self.log() returns at once

    def __post_init__(self) -> None:
        self.strategy = _DryRunStrategy(self.transform, self.world_size)


@contextmanager
def attached(model: nn.Module, trainer: DryRunTrainer) -> Iterator[None]:
    """``model.trainer`` is ``trainer`` inside (LightningModules only), and what it had before afterwards."""
    if not hasattr(model, "_trainer"):
        yield
        return
    before = model._trainer
    trainer.lightning_module = model
    model._trainer = trainer
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*self\.log.*")
            yield
    finally:
        model._trainer = before


def prime_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer state as after step 1, without running step 1: zero gradients, one step."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def run_step(
    model: nn.Module,
    batch: Any,
    optimizer: torch.optim.Optimizer,
    tracker: StepTracker,
    autocast_dtype: torch.dtype | None,
    accumulate_grad_batches: int = 1,
    step_context: AbstractContextManager | None = None,
    first_forward: AbstractContextManager | None = None,
) -> None:
    """One optimizer step: ``accumulate_grad_batches`` forwards and backwards, then the optimizer step.
    ``step_context`` wraps each ``training_step`` (activation offloading, as the strategy does);
    ``first_forward`` the first one only."""
    model.train()
    for index in range(accumulate_grad_batches):
        with (
            tracker.phase("forward"),
            first_forward if index == 0 and first_forward is not None else nullcontext(),
            step_context or nullcontext(),  # innermost saved-tensor hooks win: offloading reports to the counter
            torch.autocast("cpu", dtype=autocast_dtype or torch.float32, enabled=autocast_dtype is not None),
        ):
            output = model.training_step(batch, index) if hasattr(model, "training_step") else model(batch)
        loss = output["loss"] if isinstance(output, Mapping) else output
        del output
        with tracker.phase("backward"):
            loss.backward()
        del loss
    with tracker.phase("optimizer step"):
        if hasattr(model, "on_before_optimizer_step"):
            model.on_before_optimizer_step(optimizer)
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
