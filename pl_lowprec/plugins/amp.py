"""``AMPPrecision``: autocast with a configurable, skip-aware loss scaler, on CPU and CUDA.

Lightning's ``MixedPrecision`` hides the GradScaler settings, turns fp16 into bf16 on CPU, and keeps stepping
the LR scheduler when an overflow made the optimizer step a no-op. This plugin extends it so that:

- fp16 means fp16 on every device (``torch.amp.GradScaler("cpu")`` on CPU);
- dynamic or static scaling and all GradScaler settings come from arguments (and so from YAML);
- each optimizer step's outcome is recorded (``loss_scale_state()``), skipped steps leave the parameters,
  the optimizer state and ``interval="step"`` schedulers untouched, and a scale that collapses below
  ``min_scale`` stops the run with its history;
- gradients are unscaled exactly once before clipping, in automatic and in manual optimization.

The step is the one of the plain loop: ``scaler.scale(loss).backward()`` per micro-batch, then ``unscale_``,
clip, ``scaler.step``, ``scaler.update`` once per accumulation window.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal, get_args

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn
from torch.optim import LBFGS, Optimizer

from pl_lowprec.plugins.dtype_checks import (
    format_names,
    half_trainable_parameters,
    upcast_parameters,
    verify_bf16_support,
)
from pl_lowprec.plugins.loss_scale import LossScaleCollapseError, LossScaleState, LossScaleTracker
from pl_lowprec.plugins.scheduler_guard import guard_step_schedulers

AMPPrecisionInput = Literal["16-mixed", "bf16-mixed"]
LossScaleInput = Literal["auto", "dynamic"] | float | None

_DYNAMIC_DEFAULTS = {"init_scale": 2.0**16, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000}


class AMPPrecision(MixedPrecision):
    """Automatic mixed precision (fp16 or bf16) with an honest, configurable loss scaler.

    Args:
        precision: ``"16-mixed"`` (fp16 autocast, loss scaling on by default) or ``"bf16-mixed"``.
        loss_scale: ``"dynamic"`` (GradScaler), a positive float (static scaling: overflowing steps are still
            skipped), ``None`` (no scaling) or ``"auto"``: dynamic for fp16, none for bf16.
        init_scale: Starting scale of dynamic scaling.
        growth_factor: Scale multiplier after ``growth_interval`` steps without overflow.
        backoff_factor: Scale multiplier after an overflow.
        growth_interval: Overflow-free steps before the scale grows.
        min_scale: Dynamic scaling below this stops training with ``LossScaleCollapseError`` and the scale
            history. ``None`` never stops.
        skip_scheduler_on_overflow: Do not step ``interval="step"`` LR schedulers after a skipped step.
        upcast_trainable: Under fp16, cast trainable fp16 parameters to fp32 (and say so) instead of failing.
        device: Autocast device type. ``None`` takes the Trainer's device at setup.
    """

    def __init__(
        self,
        precision: AMPPrecisionInput,
        loss_scale: LossScaleInput = "auto",
        init_scale: float = 65536.0,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float | None = 1.0,
        skip_scheduler_on_overflow: bool = True,
        upcast_trainable: bool = False,
        device: Literal["cpu", "cuda"] | None = None,
    ) -> None:
        if precision not in get_args(AMPPrecisionInput):
            raise ValueError(
                f"AMPPrecision(precision={precision!r}) is not supported. Allowed: '16-mixed' (fp16 autocast with"
                " loss scaling) or 'bf16-mixed'. For fp32 or pure half precision use Lightning's"
                " Trainer(precision='32-true' | 'bf16-true' | '16-true') without this plugin."
            )
        dynamic = {
            "init_scale": init_scale,
            "growth_factor": growth_factor,
            "backoff_factor": backoff_factor,
            "growth_interval": growth_interval,
        }
        self.loss_scale_mode, static_scale = _resolve_loss_scale(precision, loss_scale, dynamic, min_scale)
        scaler = None
        if self.loss_scale_mode is not None:
            scaler_device = device or ("cuda" if torch.cuda.is_available() else "cpu")
            init = static_scale if self.loss_scale_mode == "static" else init_scale
            scaler = torch.amp.GradScaler(
                scaler_device,
                init_scale=init,
                growth_factor=growth_factor,
                backoff_factor=backoff_factor,
                growth_interval=growth_interval,
            )
        super().__init__(precision, device=device or "cpu", scaler=scaler)
        self.scaler = scaler  # MixedPrecision would create a default fp16 scaler for loss_scale=None
        self.device = device  # resolved from the Trainer in ``convert_module`` when None
        self.static_scale = static_scale
        self.min_scale = min_scale if self.loss_scale_mode == "dynamic" else None
        self.skip_scheduler_on_overflow = skip_scheduler_on_overflow
        self.upcast_trainable = upcast_trainable
        self._tracker = LossScaleTracker()
        self._unscaled: set[int] = set()
        self._applied: set[int] = set()
        self._skipped_by_optimizer: dict[int, bool] = {}
        self._hook_handles: list[Any] = []

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype autocast computes in: the real one, also on CPU."""
        return torch.float16 if self.precision == "16-mixed" else torch.bfloat16

    def loss_scale_state(self) -> LossScaleState:
        """Scale and step counters after the latest optimizer step (scale 1.0 when not scaling)."""
        scale = self.scaler.get_scale() if self.scaler is not None else 1.0
        return self._tracker.snapshot(scale)

    # -- set-up: device, dtype checks, optimizer hooks ------------------------------------------------------

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Runs in ``strategy.setup`` before optimizers exist: resolve the device and check dtypes."""
        if self.device is None:
            trainer = getattr(module, "_trainer", None)
            self.device = trainer.strategy.root_device.type if trainer is not None else "cpu"
        if self.precision == "bf16-mixed":
            verify_bf16_support(torch.device(self.device))
        else:
            self._check_half_trainable(module)
        return module

    def _check_half_trainable(self, module: nn.Module) -> None:
        names = half_trainable_parameters(module)
        if not names:
            return
        if not self.upcast_trainable:
            raise ValueError(
                f"AMPPrecision('16-mixed') found {len(names)} trainable parameters stored in fp16:"
                f" {format_names(names)}. Mixed precision keeps fp32 master weights; fp16 gradients cannot be"
                " unscaled ('Attempting to unscale FP16 gradients'). Load the model in fp32, freeze these"
                " parameters, or pass AMPPrecision('16-mixed', upcast_trainable=True) to cast them to fp32."
            )
        added = upcast_parameters(module, names)
        rank_zero_warn(
            f"AMPPrecision(upcast_trainable=True) cast {len(names)} trainable fp16 parameters to fp32"
            f" (+{added / 2**20:.1f} MiB): {format_names(names)}."
        )

    def connect(
        self, model: nn.Module, optimizers: list[Optimizer], lr_schedulers: list[Any]
    ) -> tuple[nn.Module, list[Optimizer], list[Any]]:
        self._remove_hooks()
        if self.scaler is not None:
            for optimizer in optimizers:
                _check_optimizer_supports_scaling(optimizer)
                self._hook_handles.append(optimizer.register_step_post_hook(self._on_optimizer_stepped))
            if self.skip_scheduler_on_overflow:
                guard_step_schedulers(lr_schedulers, self.step_was_skipped)
        return super().connect(model, optimizers, lr_schedulers)

    def teardown(self) -> None:
        self._remove_hooks()
        super().teardown()

    def _remove_hooks(self) -> None:
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()

    def _on_optimizer_stepped(self, optimizer: Optimizer, args: Any, kwargs: Any) -> None:
        self._applied.add(id(optimizer))

    def step_was_skipped(self, optimizer: Optimizer) -> bool:
        """Whether the latest step of ``optimizer`` was skipped for non-finite gradients."""
        return self._skipped_by_optimizer.get(id(optimizer), False)

    # -- the step ---------------------------------------------------------------------------------------

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Optimizer,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        if closure_result is None and model.automatic_optimization:
            # ``training_step`` returned None: no backward ran, nothing to unscale or step.
            self._after_closure(model, optimizer)
            return closure_result
        self._unscale_once(optimizer)
        self._after_closure(model, optimizer)
        self._applied.discard(id(optimizer))
        output = self.scaler.step(optimizer, **kwargs)
        skipped = id(optimizer) not in self._applied
        self._skipped_by_optimizer[id(optimizer)] = skipped
        self._update_scale()
        self._tracker.record(skipped, self.scaler.get_scale() if skipped else None)
        if skipped:
            self._check_min_scale()
        return output

    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        # Manual optimization clips before ``optimizer.step()``: unscale here so the threshold means the same.
        if clip_val > 0 and self.scaler is not None:
            self._unscale_once(optimizer)
        super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    def _unscale_once(self, optimizer: Optimizer) -> None:
        if isinstance(optimizer, LightningOptimizer):  # ``self.optimizers()`` in manual optimization
            optimizer = optimizer.optimizer
        if id(optimizer) not in self._unscaled:
            self.scaler.unscale_(optimizer)
            self._unscaled.add(id(optimizer))

    def _update_scale(self) -> None:
        if self.loss_scale_mode == "static":
            self.scaler.update(new_scale=self.static_scale)
        else:
            self.scaler.update()
        self._unscaled.clear()

    def _check_min_scale(self) -> None:
        scale = self.scaler.get_scale()
        if self.min_scale is None or scale >= self.min_scale:
            return
        t = self._tracker
        raise LossScaleCollapseError(
            f"The loss scale fell to {scale:g}, below min_scale={self.min_scale:g}: the gradients held inf/NaN"
            f" on {t.consecutive_overflows} consecutive optimizer steps ({t.skipped_steps} of"
            f" {t.optimizer_steps} steps skipped in all). Recent back-offs: {t.describe_history()}."
            " Usual causes: a NaN in the data or the loss, a diverging learning rate, or activations beyond"
            " fp16's range (max 65504). Fixes: check the loss for NaN, lower the learning rate, use"
            " AMPPrecision('bf16-mixed') where the hardware has bf16, or lower min_scale."
        )

    # -- checkpoints ------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        scaler_state = self.scaler.state_dict() if self.scaler is not None else {}
        return {"scaler": scaler_state, "tracker": self._tracker.state_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Accepts this plugin's state and a bare GradScaler state (Lightning's ``MixedPrecision``)."""
        if "tracker" in state_dict:
            self._tracker.load_state_dict(state_dict["tracker"])
        scaler_state = state_dict.get("scaler", state_dict if "scale" in state_dict else {})
        if self.scaler is None or not scaler_state:
            return
        if self.loss_scale_mode == "static":
            scaler_state = {**scaler_state, "scale": self.static_scale}
        self.scaler.load_state_dict(scaler_state)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # A checkpoint written with Trainer(precision="16-mixed") stores the scaler under "MixedPrecision".
        if type(self).__qualname__ not in checkpoint and MixedPrecision.__qualname__ in checkpoint:
            self.load_state_dict(checkpoint[MixedPrecision.__qualname__])


def _resolve_loss_scale(
    precision: str, loss_scale: LossScaleInput, dynamic: dict[str, float], min_scale: float | None
) -> tuple[Literal["dynamic", "static"] | None, float | None]:
    """Validate the scaling arguments; return the mode and the static scale."""
    changed = [f"{k}={v!r}" for k, v in dynamic.items() if v != _DYNAMIC_DEFAULTS[k]]
    if loss_scale == "auto":
        loss_scale = "dynamic" if precision == "16-mixed" else None
    if precision == "bf16-mixed" and (loss_scale is not None or changed):
        given = f"loss_scale={loss_scale!r}" if loss_scale is not None else ", ".join(changed)
        raise ValueError(
            f"AMPPrecision('bf16-mixed', {given}): loss scaling is for fp16 only. bf16 has fp32's exponent range,"
            " so its gradients do not underflow. Remove the loss-scale arguments, or use '16-mixed'."
        )
    if loss_scale is None:
        return None, None
    if loss_scale == "dynamic":
        _validate_dynamic(dynamic, min_scale)
        return "dynamic", None
    if isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float)):
        raise ValueError(
            f"AMPPrecision(loss_scale={loss_scale!r}) is not valid. Allowed: 'dynamic', a positive float for"
            " static scaling (e.g. 1024.0), None for no scaling, or 'auto' (dynamic for fp16)."
        )
    if not (math.isfinite(loss_scale) and loss_scale > 0):
        raise ValueError(f"AMPPrecision(loss_scale={loss_scale!r}): a static loss scale must be finite and > 0.")
    if changed:
        raise ValueError(
            f"AMPPrecision(loss_scale={loss_scale!r}, {', '.join(changed)}): init_scale, growth_factor,"
            " backoff_factor and growth_interval apply to loss_scale='dynamic' only. Remove them or switch to"
            " dynamic scaling."
        )
    return "static", float(loss_scale)


def _validate_dynamic(dynamic: dict[str, float], min_scale: float | None) -> None:
    init_scale, growth, backoff, interval = (dynamic[k] for k in _DYNAMIC_DEFAULTS)
    problems = []
    if not (math.isfinite(init_scale) and init_scale > 0):
        problems.append(f"init_scale={init_scale!r} must be finite and > 0")
    if not growth > 1.0:
        problems.append(f"growth_factor={growth!r} must be > 1.0")
    if not 0.0 < backoff < 1.0:
        problems.append(f"backoff_factor={backoff!r} must be between 0 and 1")
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        problems.append(f"growth_interval={interval!r} must be an integer >= 1")
    if min_scale is not None and not 0 < min_scale <= init_scale:
        problems.append(f"min_scale={min_scale!r} must be > 0 and <= init_scale ({init_scale!r}), or None")
    if problems:
        raise ValueError(
            "AMPPrecision dynamic loss scaling: "
            + "; ".join(problems)
            + ". For a fixed scale pass loss_scale=<float> instead."
        )


def _check_optimizer_supports_scaling(optimizer: Optimizer) -> None:
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
