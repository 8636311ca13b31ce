"""Which optimizer steps a plugin without its own counts applied: seen, not inferred from the scale.

Lightning's ``MixedPrecision`` and ``FSDPPrecision`` keep no count of skipped steps. Their GradScaler skips
``optimizer.step()`` on an overflow, and they update the scale after each optimizer's step, so a batch of two
optimizers may grow the scale after the first and back it off after the second: the scale reads unchanged and a
count inferred from it misses the skip (and the growth). ``StepOutcomes`` sees each step the plugin attempts
(``on_before_optimizer_step``, which Lightning calls before ``scaler.step``) and each one the optimizer really took
(its step post-hook; for a fused optimizer, which GradScaler steps even on an overflow, the ``found_inf`` it
was handed: ``step_applied``), so it knows which optimizer skipped, exactly.
"""

from __future__ import annotations

import torch
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from pl_lowprec.plugins.step_applied import step_applied


class StepOutcomes:
    """``(optimizer index, applied)`` for each optimizer step attempted since the last ``take``."""

    def __init__(self) -> None:
        self._numbers: dict[int, int] = {}  # id(optimizer) -> its index in trainer.optimizers
        self._hooks: list[RemovableHandle] = []
        self._steps: list[list[int | bool | torch.Tensor]] = []  # [index, applied]

    @property
    def watching(self) -> bool:
        return bool(self._hooks)

    def watch(self, optimizers: list[Optimizer]) -> None:
        self.release()
        self._numbers = {id(optimizer): i for i, optimizer in enumerate(optimizers)}
        self._hooks = [optimizer.register_step_post_hook(self._applied) for optimizer in optimizers]

    def release(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._steps.clear()

    def attempt(self, optimizer: Optimizer) -> None:
        """A step of ``optimizer`` is about to go through the scaler."""
        self._steps.append([self._numbers.get(id(optimizer), 0), False])

    def _applied(self, optimizer: Optimizer, args: object, kwargs: object) -> None:
        number = self._numbers.get(id(optimizer))
        if self._steps and self._steps[-1][0] == number:
            self._steps[-1][1] = step_applied(optimizer)

    def take(self) -> list[tuple[int, bool]]:
        """The steps attempted since the last call, in order, each with whether the optimizer applied it."""
        steps = [(int(number), bool(applied)) for number, applied in self._steps]
        self._steps.clear()
        return steps
