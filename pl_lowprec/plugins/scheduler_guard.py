"""Hold a per-step LR scheduler back when the loss scaler skipped the optimizer step.

Lightning steps ``interval="step"`` schedulers after every optimizer step, including the ones that
``GradScaler`` silently turned into no-ops (Lightning #5558, #16228, #18828). The schedule then runs ahead of
the updates that really happened. ``SkipAwareScheduler`` sits in ``LRSchedulerConfig.scheduler`` and forwards
everything to the user's scheduler except ``step()`` after a skipped optimizer step. Its ``state_dict`` is the
wrapped scheduler's, so checkpoints stay interchangeable with plain Lightning.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.optim import Optimizer


class SkipAwareScheduler:
    """Forwards to ``scheduler``; ``step()`` does nothing when ``step_was_skipped(scheduler.optimizer)``."""

    def __init__(self, scheduler: Any, step_was_skipped: Callable[[Optimizer], bool]) -> None:
        self.scheduler = scheduler
        self._step_was_skipped = step_was_skipped

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self._step_was_skipped(self.scheduler.optimizer):
            return
        self.scheduler.step(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        # Only called for attributes not found on the guard: optimizer, state_dict, get_last_lr, ...
        return getattr(self.__dict__["scheduler"], name)

    def __repr__(self) -> str:
        return f"SkipAwareScheduler({self.scheduler!r})"


def guard_step_schedulers(lr_scheduler_configs: list[Any], step_was_skipped: Callable[[Optimizer], bool]) -> None:
    """Wrap, in place, every ``interval="step"`` scheduler of Lightning's configs (once)."""
    for config in lr_scheduler_configs:
        if config.interval == "step" and not isinstance(config.scheduler, SkipAwareScheduler):
            config.scheduler = SkipAwareScheduler(config.scheduler, step_was_skipped)
