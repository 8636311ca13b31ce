"""The arguments a resumed learning-rate scheduler keeps from the checkpoint instead of this run's.

torch's schedulers save their constructor arguments with their position (``CosineAnnealingLR``'s ``T_max``,
``OneCycleLR``'s ``total_steps``, ``LinearLR``'s ``total_iters``, ``SequentialLR``'s milestones), and Lightning's
restore loads that state over the scheduler ``configure_optimizers`` just built. A run resumed with a raised
``max_steps`` (the documented way to train on) therefore builds ``CosineAnnealingLR(T_max=trainer.max_steps)`` for
the new length and trains on the saved one, without a word: past the saved length the cosine rate climbs back up,
and ``OneCycleLR`` stops the run with an error. A ``LambdaLR`` (transformers' ``get_*_schedule_with_warmup``) keeps
no argument: its function is this run's (``run_record.schedule_jumps`` says where it moves the rate).

So the strategies note each scheduler's arguments as built (``built_arguments``, before Lightning restores), and
``kept_arguments`` says, as training starts, every one the checkpoint replaced.
"""

from __future__ import annotations

import inspect
from collections import Counter
from typing import Any

NOT_ARGUMENTS = ("self", "optimizer", "last_epoch", "verbose", "schedulers")


def built_arguments(lr_scheduler_configs: list[Any]) -> list[dict[str, Any]]:
    """Per scheduler config: ``{"<class> <argument>": value}`` of every constructor argument its state holds, as
    ``configure_optimizers`` built it (nested schedulers of ``SequentialLR`` and ``ChainedScheduler`` included)."""
    return [_arguments(config.scheduler) for config in lr_scheduler_configs]


def _arguments(scheduler: Any, prefix: str = "") -> dict[str, Any]:
    name = f"{prefix}{type(scheduler).__name__}"
    try:
        state = scheduler.state_dict()
    except (AttributeError, TypeError, RuntimeError):  # not a torch scheduler: unknown state
        return {}
    parameters = inspect.signature(type(scheduler).__init__).parameters
    found = {}
    for argument in parameters:
        if argument in NOT_ARGUMENTS:
            continue
        for key in (argument, f"_{argument}"):  # SequentialLR keeps its milestones as _milestones
            if key in state and isinstance(state[key], int | float | list | tuple | Counter):
                found[f"{name} {argument}"] = _plain(state[key])
                break
    for number, inner in enumerate(getattr(scheduler, "_schedulers", None) or []):
        found.update(_arguments(inner, f"{name}[{number}] "))
    return found


def _plain(value: Any) -> Any:
    """A value as it reads in a message: a ``Counter`` of milestones as their sorted list."""
    return sorted(value.elements()) if isinstance(value, Counter) else value


def kept_arguments(lr_scheduler_configs: list[Any], built: list[dict[str, Any]] | None) -> list[str]:
    """``"<class> <argument>=<saved> (this run built <value>)"`` for each argument the restored state replaced."""
    if not built or len(built) != len(lr_scheduler_configs):
        return []
    said = []
    for config, as_built in zip(lr_scheduler_configs, built, strict=True):
        restored = _arguments(config.scheduler)
        for key, value in as_built.items():
            if key in restored and restored[key] != value:
                said.append(f"{key}={restored[key]} (this run built {value})")
    return said
