"""``LossScaleConfig``: ``AMPPrecision``'s loss-scale arguments, checked once when the plugin is built.

Bad settings fail before the Trainer exists, even under ``precision="auto"``, where they are checked as for fp16
(the only precision they apply to) and used only if ``"auto"`` chooses it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, Literal

import torch

AMPPrecisionInput = Literal["auto", "16-mixed", "bf16-mixed"]
LossScaleInput = Literal["auto", "dynamic"] | float | None
LossScaleMode = Literal["dynamic", "static"]

_DYNAMIC_SETTINGS = ("init_scale", "growth_factor", "backoff_factor", "growth_interval")
# The settings GradScaler saves beside the scale and the growth tracker.
_SAVED_SETTINGS = ("growth_factor", "backoff_factor", "growth_interval")


@dataclass(frozen=True)
class LossScaleConfig:
    """How ``AMPPrecision`` scales the loss (the arguments of the same names, documented there).

    Args:
        precision: The plugin's requested precision: ``"bf16-mixed"`` refuses any loss-scale setting, and
            ``"auto"`` checks them as for ``"16-mixed"``.
    """

    precision: AMPPrecisionInput = "16-mixed"
    loss_scale: LossScaleInput = "auto"
    init_scale: float = 65536.0
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    min_scale: float | None = 1.0

    def __post_init__(self) -> None:
        _check(self, "16-mixed" if self.precision == "auto" else self.precision)

    def mode(self, precision: str) -> LossScaleMode | None:
        """How a run at ``precision`` (as resolved, never ``"auto"``) scales; ``None``: no scaler."""
        if precision != "16-mixed" or self.loss_scale is None:
            return None
        return "dynamic" if self.loss_scale in ("auto", "dynamic") else "static"

    @property
    def static_scale(self) -> float | None:
        """The fixed scale of ``loss_scale=<float>``; ``None`` otherwise."""
        return None if self.loss_scale in ("auto", "dynamic", None) else float(self.loss_scale)

    def make_scaler(self, precision: str, device: str) -> torch.amp.GradScaler | None:
        """The GradScaler a run at ``precision`` needs on ``device`` (a static scale is its initial scale)."""
        mode = self.mode(precision)
        if mode is None:
            return None
        return torch.amp.GradScaler(
            device,
            init_scale=self.static_scale if mode == "static" else self.init_scale,
            growth_factor=self.growth_factor,
            backoff_factor=self.backoff_factor,
            growth_interval=self.growth_interval,
        )

    def changed_settings(self) -> str:
        """The settings given other than their defaults, as ``"loss_scale='dynamic', growth_interval=50"``."""
        changed = _changed_dynamic_settings(self)
        if self.loss_scale != "auto":
            changed.insert(0, f"loss_scale={self.loss_scale!r}")
        return ", ".join(changed)


def _changed_dynamic_settings(config: LossScaleConfig) -> list[str]:
    defaults = {f.name: f.default for f in fields(LossScaleConfig)}
    return [f"{k}={getattr(config, k)!r}" for k in _DYNAMIC_SETTINGS if getattr(config, k) != defaults[k]]


def _check(config: LossScaleConfig, precision: str) -> None:
    """The loss-scale arguments as a run at ``precision`` would use them; ``ValueError`` naming what is wrong."""
    changed = _changed_dynamic_settings(config)
    loss_scale = config.loss_scale
    if loss_scale == "auto":
        loss_scale = "dynamic" if precision == "16-mixed" else None
    if precision == "bf16-mixed" and (loss_scale is not None or changed):
        given = f"loss_scale={loss_scale!r}" if loss_scale is not None else ", ".join(changed)
        raise ValueError(
            f"AMPPrecision('bf16-mixed', {given}): loss scaling is for fp16 only. bf16 has fp32's exponent range,"
            " so its gradients do not underflow. Remove the loss-scale arguments, or use '16-mixed'."
        )
    if loss_scale is None:
        return
    if loss_scale == "dynamic":
        _check_dynamic(config)
        return
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


def _check_dynamic(config: LossScaleConfig) -> None:
    init_scale, growth, backoff, interval = (getattr(config, k) for k in _DYNAMIC_SETTINGS)
    min_scale = config.min_scale
    problems = []
    valid_init = math.isfinite(init_scale) and init_scale > 0
    if not valid_init:
        problems.append(f"init_scale={init_scale!r} must be finite and > 0")
    if not growth > 1.0:
        problems.append(f"growth_factor={growth!r} must be > 1.0")
    if not 0.0 < backoff < 1.0:
        problems.append(f"backoff_factor={backoff!r} must be between 0 and 1")
    if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
        problems.append(f"growth_interval={interval!r} must be an integer >= 1")
    if min_scale is not None and valid_init and not 0 < min_scale <= init_scale:  # else one problem told as two
        problems.append(f"min_scale={min_scale!r} must be > 0 and <= init_scale ({init_scale!r}), or None")
    if problems:
        raise ValueError(
            "AMPPrecision dynamic loss scaling: "
            + "; ".join(problems)
            + ". For a fixed scale pass loss_scale=<float> instead."
        )


def check_own_scaler(scaler: object, precision: str, config: LossScaleConfig) -> None:
    """``AMPPrecision(scaler=...)``: a scaler of the user's replaces the one the loss-scale settings would build."""
    if precision != "16-mixed":
        raise ValueError(
            f"AMPPrecision(precision={precision!r}, scaler={type(scaler).__name__}(...)): a loss scaler is for fp16"
            " only ('16-mixed'); bf16 does not scale, and 'auto' may choose bf16. Pass precision='16-mixed' with"
            " your scaler, or drop scaler=."
        )
    changed = _changed_dynamic_settings(config)
    if config.loss_scale not in ("auto", "dynamic") or changed:
        given = ", ".join([*([f"loss_scale={config.loss_scale!r}"] if config.loss_scale != "auto" else []), *changed])
        raise ValueError(
            f"AMPPrecision(scaler={type(scaler).__name__}(...), {given}): the scaler you pass carries its own"
            " settings, so the loss-scale arguments would be ignored. Set them on your scaler, or drop scaler= and"
            " keep the arguments."
        )


def resumed_scaler_state(
    saved: dict[str, Any], scaler: torch.amp.GradScaler
) -> tuple[dict[str, Any], dict[str, tuple[Any, Any]]]:
    """The checkpoint's scaler state with ``scaler``'s settings (this run's arguments), and each setting that
    differs as ``{name: (checkpoint's, this run's)}``.

    The scale and the growth tracker resume; GradScaler's own ``load_state_dict`` would also bring back the
    checkpoint's settings over the ones this run was given. A growth tracker at or past a smaller new
    ``growth_interval`` is set to one step short of it: GradScaler grows the scale only when the tracker reaches
    the interval exactly, so it would never grow again before an overflow.
    """
    mine: dict[str, Any] = {name: getattr(scaler, f"get_{name}")() for name in _SAVED_SETTINGS}
    changed = {k: (saved[k], mine[k]) for k in _SAVED_SETTINGS if k in saved and saved[k] != mine[k]}
    state = {**saved, **mine}
    tracker = saved.get("_growth_tracker")
    if tracker is not None and tracker >= mine["growth_interval"]:
        state["_growth_tracker"] = mine["growth_interval"] - 1
    return state, changed


def device_type(device: str | None) -> str | None:
    """``"cuda:0"`` as autocast and GradScaler take it (``"cuda"``), as Lightning's ``MixedPrecision`` accepts."""
    return None if device is None else torch.device(device).type
