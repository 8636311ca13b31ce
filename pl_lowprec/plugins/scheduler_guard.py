"""Hold a per-step LR scheduler back when the loss scaler skipped the optimizer step.

Lightning steps ``interval="step"`` schedulers after every optimizer step, including the ones that
``GradScaler`` silently turned into no-ops (Lightning #5558, #16228, #18828). The schedule then runs ahead of
the updates that really happened. ``guard_step_schedulers`` gives each such scheduler a class of its own that
derives from the scheduler's class and ``SkipAwareScheduler``, whose ``step()`` does nothing after a skipped
optimizer step. The scheduler stays the same object of (a subclass of) the same class: ``isinstance(sch,
ReduceLROnPlateau)`` in a ``training_step`` or an ``lr_scheduler_step`` override still holds, its attributes
and ``state_dict`` are untouched, and checkpoints stay interchangeable with plain Lightning.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

from torch.optim import Optimizer


class SkipAwareScheduler:
    """Mixed into a guarded scheduler's class: ``step()`` does nothing when the latest step of the scheduler's
    optimizer was skipped, and is the scheduler's own ``step()`` otherwise. Test for it with ``isinstance``."""

    _step_was_skipped: ClassVar[Callable[[Optimizer], bool]]

    def step(self, *args: Any, **kwargs: Any) -> Any:
        if type(self)._step_was_skipped(self.optimizer):  # type: ignore[attr-defined]
            return None
        return super().step(*args, **kwargs)  # type: ignore[misc]

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        # Pickled as the scheduler's own class (the guard's class is made per fit and named as that one, which
        # pickle refuses): the guard belongs to the fit, not to the object.
        own = type(self).__bases__[1]  # guard_scheduler's (SkipAwareScheduler, the scheduler's class)
        return unguarded, (own, self.__dict__.copy())


def unguarded(cls: type, state: dict[str, Any]) -> Any:
    """A guarded scheduler unpickled: an object of its own class with its attributes."""
    scheduler = cls.__new__(cls)
    scheduler.__dict__.update(state)
    return scheduler


def guard_scheduler(scheduler: Any, step_was_skipped: Callable[[Optimizer], bool]) -> None:
    """Make ``scheduler`` skip-aware in place (again with the latest ``step_was_skipped`` if it already is).

    Its class becomes one made for it alone, named as its own, so the guard of one fit never reaches another
    scheduler of the same class."""
    cls = type(scheduler)
    if not issubclass(cls, SkipAwareScheduler):
        namespace = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
        cls = type(cls)(cls.__name__, (SkipAwareScheduler, cls), namespace)
        scheduler.__class__ = cls
    cls._step_was_skipped = staticmethod(step_was_skipped)


def guard_step_schedulers(lr_scheduler_configs: list[Any], step_was_skipped: Callable[[Optimizer], bool]) -> None:
    """Guard, in place, every ``interval="step"`` scheduler of Lightning's configs."""
    for config in lr_scheduler_configs:
        if config.interval == "step":
            guard_scheduler(config.scheduler, step_was_skipped)
