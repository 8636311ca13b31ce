"""Swap the optimizer that ``configure_optimizers`` built for its bitsandbytes 8-bit (or paged) equivalent, or
torchao's 8-bit AdamW.

The parameter groups and their hyperparameters move over unchanged, and every LR scheduler bound to the old
optimizer is re-bound to the new one, so the schedule continues as configured. bitsandbytes keeps 32-bit state
for tensors under 4096 elements (its ``min_8bit_size``); larger ones get uint8 state. torchao's ``AdamW8bit``
(``"torchao_adamw8bit"``) does the same (8-bit blocks of 256 for tensors of 4096 elements or more) and, unlike
bitsandbytes' kernels, steps on FSDP2's DTensor shards.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Literal, get_args

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer

from pl_lowprec._imports import import_bitsandbytes, import_torchao

OptimizerName = Literal["adamw8bit", "paged_adamw8bit", "paged_adamw32bit", "lion8bit", "torchao_adamw8bit"]
OPTIMIZER_NAMES: tuple[str, ...] = get_args(OptimizerName)
TORCHAO_OPTIMIZERS = ("torchao_adamw8bit",)
BITSANDBYTES_OPTIMIZERS = tuple(name for name in OPTIMIZER_NAMES if name not in TORCHAO_OPTIMIZERS)
_CLASSES = {
    "adamw8bit": "AdamW8bit",
    "paged_adamw8bit": "PagedAdamW8bit",
    "paged_adamw32bit": "PagedAdamW32bit",
    "lion8bit": "Lion8bit",
}
_UNPAGED = {"paged_adamw8bit": "AdamW8bit", "paged_adamw32bit": "AdamW32bit"}
_HYPERPARAMETERS = ("lr", "betas", "eps", "weight_decay")


def validate_optimizer_name(name: str) -> None:
    if name not in OPTIMIZER_NAMES:
        raise ValueError(
            f"optimizer={name!r} is not supported. Allowed: {', '.join(map(repr, OPTIMIZER_NAMES))}"
            " (each replaces the AdamW/Adam that configure_optimizers returns)."
        )


def import_optimizer_library(name: str) -> None:
    """Fail when the strategy is built if the library behind ``name`` is not installed."""
    if name in TORCHAO_OPTIMIZERS:
        import_torchao()
    else:
        import_bitsandbytes()


def optimizer_class(name: str, device: torch.device) -> type[Optimizer]:
    if name == "torchao_adamw8bit":
        import_torchao()
        from torchao.optim import AdamW8bit

        return AdamW8bit
    return bitsandbytes_class(name, device)


def bitsandbytes_class(name: str, device: torch.device) -> type[Optimizer]:
    """The bitsandbytes class for ``name``; paged variants fall back to unpaged off CUDA, with a warning."""
    bnb = import_bitsandbytes()
    cls_name = _CLASSES[name]
    if name in _UNPAGED and device.type != "cuda":
        cls_name = _UNPAGED[name]
        rank_zero_warn(
            f"optimizer={name!r} pages optimizer state through CUDA unified memory, which {device.type} does not"
            f" have: using bitsandbytes.optim.{cls_name} (same update, unpaged)."
        )
    return getattr(bnb.optim, cls_name)


def swap_optimizer(optimizer: Optimizer, name: str, device: torch.device) -> Optimizer:
    """A bitsandbytes (or torchao) optimizer over the same parameter groups and hyperparameters as ``optimizer``."""
    check_swappable(optimizer, name)
    cls = optimizer_class(name, device)
    carried = _HYPERPARAMETERS
    groups = []
    for group in optimizer.param_groups:
        keys = [k for k in group if k not in optimizer.defaults or k in carried]
        groups.append({k: group[k] for k in keys})  # params, hyperparameters, and extras such as initial_lr
    defaults = {k: optimizer.defaults[k] for k in carried if k in optimizer.defaults}
    if cls.__name__ == "Lion8bit":
        defaults.pop("eps", None)
        for group in groups:
            group.pop("eps", None)
    return cls(groups, **defaults)


def check_swappable(optimizer: Optimizer, name: str) -> None:
    """Refuse what ``optimizer=name`` cannot replace: an optimizer other than Adam/AdamW, Adam's L2 weight decay,
    and the options the swapped optimizer lacks (``check_options_carry_over``)."""
    source = type(optimizer).__name__
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        raise ValueError(
            f"optimizer={name!r} replaces Adam or AdamW, but configure_optimizers returned {source}. Return"
            " torch.optim.AdamW there, or drop optimizer= to keep your optimizer."
        )
    decoupled = isinstance(optimizer, torch.optim.AdamW) or optimizer.defaults.get("decoupled_weight_decay")
    if not decoupled and any(group["weight_decay"] for group in optimizer.param_groups):
        raise ValueError(
            f"optimizer={name!r} uses decoupled weight decay (AdamW), but {source} applies weight_decay as an L2"
            " term. Use torch.optim.AdamW in configure_optimizers, or weight_decay=0."
        )
    check_options_carry_over(optimizer, name)


def check_options_carry_over(optimizer: Optimizer, name: str) -> None:
    """Refuse an option of the user's Adam/AdamW that changes its update and that the swapped optimizer lacks:
    ``maximize`` (every 8-bit optimizer would minimize) and ``amsgrad`` (bitsandbytes' kernels have none, and
    torchao 0.18's ``AdamW8bit(amsgrad=True)`` fails in its first step). Dropped silently, the run would train
    another objective or update."""
    given = sorted({k for group in optimizer.param_groups for k in ("maximize", "amsgrad") if group.get(k)})
    if given:
        options = ", ".join(f"{k}=True" for k in given)
        raise ValueError(
            f"configure_optimizers returned {type(optimizer).__name__}({options}), and optimizer={name!r} has no such"
            f" option: the swapped optimizer would {'minimize' if 'maximize' in given else 'drop AMSGrad'}."
            f" Drop {options} from configure_optimizers, or drop optimizer= to keep your optimizer."
        )


def swap_line(old: Optimizer, new: Optimizer, name: str) -> str:
    """One line saying what the swap did, with Lion's caution: it keeps AdamW's learning rate and betas, and
    Lion's authors use a 3-10x smaller learning rate and beta2 0.99."""
    groups = len(new.param_groups)
    line = (
        f"Optimizer: {type(old).__name__} from configure_optimizers replaced by {type(new).__module__.split('.')[0]}"
        f" {type(new).__name__} (optimizer={name!r}) over the same {groups} parameter group"
        f"{'s' if groups != 1 else ''}, learning rates and schedule."
    )
    if type(new).__name__.startswith("Lion"):
        line += (
            " Lion takes the AdamW learning rate and betas as given; its authors use a 3-10x smaller learning rate"
            " and betas (0.9, 0.99)."
        )
    return line


def rebind_schedulers(lr_scheduler_configs: list[Any], old: Optimizer, new: Optimizer) -> None:
    """Point the schedulers of ``old`` at ``new``, keeping torch's check that the optimizer steps first."""
    for config in lr_scheduler_configs:
        scheduler = config.scheduler
        if scheduler.optimizer is old:
            scheduler.optimizer = new
            _track_step_calls(new)


def _track_step_calls(optimizer: Optimizer) -> None:
    # torch's LRScheduler wraps optimizer.step at construction to warn when the scheduler steps first; give the
    # new optimizer the same marker, or every run would warn that step() was overridden.
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    step = type(optimizer).step
    ref = weakref.ref(optimizer)

    @functools.wraps(step)
    def tracked(*args: Any, **kwargs: Any) -> Any:
        opt = ref()
        opt._opt_called = True  # type: ignore[union-attr]
        return step(opt, *args, **kwargs)

    tracked._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = tracked  # type: ignore[method-assign]
