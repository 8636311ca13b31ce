"""Per-optimizer bookkeeping around one ``torch.amp.GradScaler``: unscale once, see skipped steps, know which
steps await the scale update, forget half-done unscales.

GradScaler answers none of the questions an honest training loop asks: whether this optimizer's gradients are
already unscaled (clipping and the step must not unscale twice), whether ``scaler.step`` really applied the
update or skipped it on an overflow, which optimizers have stepped since the last ``update()`` (the plain loop
updates once, after every optimizer of the iteration stepped), and how to drop an unscale that no step followed.
``ScalerBookkeeping`` keeps these answers for ``AMPPrecision``. It sees a step through the optimizer's own step
post-hook (and, for an optimizer GradScaler steps even on an overflow, the ``found_inf`` it was handed:
``step_applied``), so an overflow that GradScaler turned into a no-op is known exactly, not guessed from the scale.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch.optim import LBFGS, Optimizer
from torch.utils.hooks import RemovableHandle

from pl_lowprec.plugins.grad_scaler_internals import agree_on_overflow, check_scaler_internals, forget_unscale
from pl_lowprec.plugins.step_applied import step_applied


class ScalerBookkeeping:
    """Which optimizers ``scaler`` has unscaled and stepped since its last update, and whether each one's latest
    step applied an update. Optimizers are keyed by ``id``, as GradScaler keys them; a ``LightningOptimizer``
    (``self.optimizers()`` in manual optimization) counts as the optimizer it wraps.

    Attributes:
        scaler: The GradScaler all unscales, steps and updates go through.
        unscaled: Optimizers unscaled since the last ``update`` and not stepped yet.
        stepped: Optimizers stepped since the last ``update``, each with the caller's mark at its step (the
            plugin's backward count), so that a backward between a step and the update can be seen.
    """

    def __init__(self, scaler: torch.amp.GradScaler) -> None:
        check_scaler_internals()
        self.scaler = scaler
        self.stepped: dict[int, int] = {}
        self._unscaled_optimizers: dict[int, Optimizer] = {}
        self._watched: dict[int, int] = {}  # id(optimizer) -> its index in configure_optimizers' list
        self._applied: dict[int, bool | torch.Tensor] = {}  # id(optimizer) -> whether its step applied
        self._skipped: dict[int, bool] = {}
        self._hooks: list[RemovableHandle] = []

    @property
    def unscaled(self) -> set[int]:
        return set(self._unscaled_optimizers)

    def watch(self, optimizers: list[Optimizer]) -> None:
        """Start a fit: refuse optimizers the scaler cannot drive, and see each one's steps. Whatever an earlier
        fit that stopped mid-step left behind is forgotten."""
        self.release()
        for optimizer in optimizers:
            check_optimizer_supports_scaling(optimizer)
            self._hooks.append(optimizer.register_step_post_hook(self._on_optimizer_stepped))
        self._watched = {id(optimizer): i for i, optimizer in enumerate(optimizers)}

    def release(self) -> None:
        """Remove the step hooks and forget every pending unscale and step (teardown, or a new fit)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._watched = {}
        for optimizer_id in self.unscaled | self.stepped.keys():
            forget_unscale(self.scaler, optimizer_id)
        self._clear()

    def number(self, optimizer: Optimizer | LightningOptimizer) -> int:
        """``optimizer``'s index in the list ``watch`` was given (overflow runs are counted per optimizer by it);
        0 for one not watched."""
        return self._watched.get(id(unwrap(optimizer)), 0)

    @property
    def optimizer_count(self) -> int:
        return len(self._watched)

    def _on_optimizer_stepped(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        self._applied[id(optimizer)] = step_applied(optimizer)

    def unscale_once(self, optimizer: Optimizer | LightningOptimizer) -> None:
        """``scaler.unscale_`` unless already done since the last update, or there are no gradients; then every
        process agrees on whether the gradients overflowed (``agree_on_overflow``)."""
        optimizer = unwrap(optimizer)
        if id(optimizer) not in self._unscaled_optimizers and has_gradients(optimizer):
            self.scaler.unscale_(optimizer)
            agree_on_overflow(self.scaler, id(optimizer))
            self._unscaled_optimizers[id(optimizer)] = optimizer

    def step(self, optimizer: Optimizer, mark: int = 0, **kwargs: Any) -> tuple[Any, bool]:
        """``scaler.step``; returns its output and whether the step was skipped (the optimizer did not step).
        ``optimizer`` then waits for ``update`` (``stepped``), with ``mark``."""
        self._applied.pop(id(optimizer), None)
        output = self.scaler.step(optimizer, **kwargs)
        skipped = not bool(self._applied.pop(id(optimizer), False))
        self._skipped[id(optimizer)] = skipped
        self._unscaled_optimizers.pop(id(optimizer), None)
        self.stepped[id(optimizer)] = mark
        return output, skipped

    def has_stepped(self, optimizer: Optimizer | LightningOptimizer) -> bool:
        """Whether ``optimizer`` stepped since the last update: GradScaler steps it again only after one."""
        return id(unwrap(optimizer)) in self.stepped

    def all_stepped(self) -> bool:
        """Whether every watched optimizer stepped since the last update: the iteration is complete."""
        return bool(self._watched) and self._watched.keys() <= self.stepped.keys()

    def mark_skipped(self, optimizer: Optimizer) -> None:
        """Record a step that had nothing to apply (no gradients), without asking the scaler."""
        self._skipped[id(optimizer)] = True

    def step_was_skipped(self, optimizer: Optimizer | LightningOptimizer) -> bool:
        """Whether the latest step of ``optimizer`` applied no update (overflow, or nothing to step)."""
        return self._skipped.get(id(unwrap(optimizer)), False)

    def update(self, new_scale: float | None = None) -> bool:
        """``scaler.update`` (a static scale passes ``new_scale``), which ends every optimizer's window; returns
        whether a step since the previous update was skipped."""
        skipped = any(self._skipped.get(optimizer_id, False) for optimizer_id in self.stepped)
        if new_scale is None:
            self.scaler.update()
        else:
            self.scaler.update(new_scale=new_scale)
        self._clear()
        return skipped

    def forget_unscale(self, optimizer: Optimizer) -> None:
        """Return ``optimizer`` to GradScaler's ready state after an ``unscale_`` that no step followed."""
        if self._unscaled_optimizers.pop(id(optimizer), None) is not None:
            forget_unscale(self.scaler, id(optimizer))

    def forget_unscales(self, only_without_gradients: bool = False) -> None:
        """Forget the unscales that no step followed: all of them (a new training batch), or only those whose
        gradients are gone (``zero_grad()`` since the unscale: the next backward brings scaled ones)."""
        for optimizer in list(self._unscaled_optimizers.values()):
            if not only_without_gradients or not has_gradients(optimizer):
                self.forget_unscale(optimizer)

    def _clear(self) -> None:
        self._unscaled_optimizers.clear()
        self.stepped.clear()


def unwrap(optimizer: Optimizer | LightningOptimizer) -> Optimizer:
    """The optimizer a ``LightningOptimizer`` (``self.optimizers()`` in manual optimization) wraps."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


def has_gradients(optimizer: Optimizer) -> bool:
    return any(p.grad is not None for group in optimizer.param_groups for p in group["params"])


def optimizer_handles_unscaling(optimizer: Optimizer | LightningOptimizer) -> bool:
    """Whether the optimizer's step unscales the gradients itself (fused optimizers): the predicate of
    Lightning's ``_optimizer_handles_unscaling``. Such gradients cannot be unscaled for clipping first."""
    return getattr(optimizer, "_step_supports_amp_scaling", False)


def check_optimizer_supports_scaling(optimizer: Optimizer) -> None:
    """Refuse optimizers whose step hides overflows from the scaler's accounting."""
    name = type(optimizer).__qualname__
    if isinstance(optimizer, LBFGS):
        raise ValueError(
            "AMPPrecision with a loss scaler cannot drive LBFGS: its closure re-evaluates the loss, which"
            " GradScaler does not support. Use AMPPrecision('bf16-mixed') or loss_scale=None."
        )
    if optimizer.defaults.get("fused"):
        raise ValueError(
            f"{name}(fused=True) unscales and skips inside its fused kernel, which hides overflowing steps from"
            f" AMPPrecision's accounting and from gradient clipping. Build it with {name}(..., fused=False);"
            " the default foreach implementation works and is fast."
        )
