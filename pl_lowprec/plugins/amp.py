"""``AMPPrecision``: autocast with a configurable, skip-aware loss scaler, on CPU and CUDA.

Lightning's ``MixedPrecision`` hides the GradScaler settings, turns fp16 into bf16 on CPU, and keeps stepping
the LR scheduler when an overflow made the optimizer step a no-op. This plugin extends it so that:

- fp16 means fp16 on every device (``torch.amp.GradScaler("cpu")`` on CPU);
- dynamic or static scaling and all GradScaler settings come from arguments (and so from YAML);
- each optimizer step's outcome is recorded (``loss_scale_state()``), skipped steps leave the parameters,
  the optimizer state and ``interval="step"`` schedulers untouched, and a scale that collapses below
  ``min_scale`` stops the run with its history;
- gradients are unscaled exactly once before clipping, in automatic and in manual optimization, and an
  unscale that no step followed (a ``training_step`` that returned ``None``, a clip without a step, an
  exception) never leaves the scaler half-done;
- ``precision="auto"`` picks what is fast and sound on the device the Trainer runs on
  (``precision_choice.py``), says what it chose and why, and records it in checkpoints;
- ``float32_matmul_precision`` sets ``torch.set_float32_matmul_precision`` for the run and restores it after.

The step is the one of the plain loop: ``scaler.scale(loss).backward()`` per micro-batch, then ``unscale_``,
clip, ``scaler.step``, ``scaler.update`` once per accumulation window. In manual optimization, where one
``training_step`` may step several optimizers, ``scaler.update`` runs once after it, as in PyTorch's loop for
several optimizers (``train_step_context``).

Beside this file: ``loss_scale_config.py`` checks the loss-scale arguments and builds the scaler,
``scaler_bookkeeping.py`` knows per optimizer what was unscaled and which steps were skipped (the only code that
reaches into GradScaler's private state is ``grad_scaler_internals.py``), ``loss_scale.py`` counts step outcomes.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any, ClassVar, Literal, get_args

import lightning.pytorch as pl
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.optim import Optimizer

from pl_lowprec._did_you_mean import closest, did_you_mean
from pl_lowprec.plugins.anomaly_mode import overflows_left_to_the_scaler
from pl_lowprec.plugins.dtype_checks import (
    format_names,
    half_trainable_parameters,
    upcast_parameters,
    verify_bf16_support,
)
from pl_lowprec.plugins.lightning_messages import hide_fp32_matmul_advice
from pl_lowprec.plugins.loss_scale import LossScaleCollapseError, LossScaleState, LossScaleTracker, steps_in_a_row
from pl_lowprec.plugins.loss_scale_config import (
    AMPPrecisionInput,
    LossScaleConfig,
    LossScaleInput,
    check_own_scaler,
    device_type,
    resumed_scaler_state,
)
from pl_lowprec.plugins.precision_choice import PrecisionChoice, choose_precision, cpu_fp16_note
from pl_lowprec.plugins.scaler_bookkeeping import (
    ScalerBookkeeping,
    has_gradients,
    optimizer_handles_unscaling,
    unwrap,
)
from pl_lowprec.plugins.scheduler_guard import guard_step_schedulers
from pl_lowprec.transforms.dtypes import dtype_of_precision

MatmulPrecision = Literal["highest", "high", "medium"]


# Other names of the two mixed precisions (Lightning's legacy "16" and "bf16", torch's dtype names).
MIXED_SPELLINGS = {
    **dict.fromkeys(("16", "fp16", "float16", "half"), "16-mixed"),
    **dict.fromkeys(("bf16", "bfloat16"), "bf16-mixed"),
}


class AMPPrecision(MixedPrecision):
    """Automatic mixed precision (fp16 or bf16) with an honest, configurable loss scaler.

    Args:
        precision: ``"auto"`` (the fast, sound choice for the Trainer's device, resolved at setup:
            bf16-mixed on GPUs with bf16 and on CPUs with AMX/avx512_bf16, 16-mixed on GPUs without bf16,
            fp32 on other CPUs), ``"16-mixed"`` (fp16 autocast, loss scaling on by default) or ``"bf16-mixed"``.
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
        float32_matmul_precision: ``torch.set_float32_matmul_precision`` for the run (``"highest"``, ``"high"``,
            ``"medium"``), restored at teardown. ``None`` leaves the process setting alone.
        device: Autocast device type (``"cuda:0"`` is read as ``"cuda"``). ``None`` takes the Trainer's device
            at setup.
        scaler: A ``torch.amp.GradScaler`` (or a subclass of your own) to use instead of the one built from the
            loss-scale settings, as Lightning's ``MixedPrecision(scaler=...)`` takes it; ``"16-mixed"`` only.
            Assigning ``plugin.scaler`` later works the same: every unscale, step and update goes through it.
    """

    # strategy="lowprec_fsdp" runs every mode (pl_lowprec.distributed.precision): the loss scaler agrees on
    # overflows across the shards.
    supports_fsdp2: ClassVar[bool] = True

    _steps: ScalerBookkeeping | None = None  # with the scaler, when there is one (the ``scaler`` setter)

    def __init__(
        self,
        precision: AMPPrecisionInput = "auto",
        loss_scale: LossScaleInput = "auto",
        init_scale: float = 65536.0,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float | None = 1.0,
        skip_scheduler_on_overflow: bool = True,
        upcast_trainable: bool = False,
        float32_matmul_precision: MatmulPrecision | None = None,
        device: Literal["cpu", "cuda"] | None = None,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        if precision not in get_args(AMPPrecisionInput):
            allowed = get_args(AMPPrecisionInput)  # 'AUTO' and 'fp16' are meant; no nearest by spelling
            said = did_you_mean(
                closest(str(precision), allowed, cutoff=None, spellings=MIXED_SPELLINGS, ignore_case=True)
            )
            raise ValueError(
                f"AMPPrecision(precision={precision!r}) is not supported.{said} Allowed: 'auto' (the fast choice for"
                " the device), '16-mixed' (fp16 autocast with loss scaling) or 'bf16-mixed'. For fp32 or pure half"
                " precision use Lightning's Trainer(precision='32-true' | 'bf16-true' | '16-true') without this"
                " plugin."
            )
        if float32_matmul_precision not in (*get_args(MatmulPrecision), None):
            raise ValueError(
                f"AMPPrecision(float32_matmul_precision={float32_matmul_precision!r}) is not valid. Allowed:"
                " 'highest' (full fp32), 'high' (TF32 on Ampere+ GPUs), 'medium' (also bf16 passes), or None to"
                " leave torch's setting alone."
            )
        # Checked now (as for fp16 under "auto"), so that bad settings fail before the Trainer exists.
        self.loss_scaling = LossScaleConfig(
            precision, loss_scale, init_scale, growth_factor, backoff_factor, growth_interval, min_scale
        )
        if scaler is not None:
            check_own_scaler(scaler, precision, self.loss_scaling)
        device = device_type(device)
        super().__init__("bf16-mixed", device=device or "cpu", scaler=None)
        self.requested_precision = precision
        self.choice: PrecisionChoice | None = None
        self.device = device  # resolved from the Trainer at setup when None
        self.skip_scheduler_on_overflow = skip_scheduler_on_overflow
        self.upcast_trainable = upcast_trainable
        self.float32_matmul_precision = float32_matmul_precision
        self._matmul_precision_before: str | None = None
        self._tracker = LossScaleTracker()
        self._backwards = 0  # backward passes so far: a backward between a step and its update shows
        self._noted_cpu_fp16 = False
        if precision == "auto":
            self.precision = "auto"
            self.scaler = None
            self.loss_scale_mode, self.static_scale, self.min_scale = None, None, None
        else:
            self._configure(precision, device or ("cuda" if torch.cuda.is_available() else "cpu"), scaler)
        hide_fp32_matmul_advice(self)

    def _configure(self, precision: str, scaler_device: str, scaler: torch.amp.GradScaler | None = None) -> None:
        """Set the precision and build the scaler it needs (or take the one given)."""
        self.precision = precision
        # Only fp16 scales; under "auto" the loss-scale settings apply only if it chose fp16.
        self.loss_scale_mode = self.loss_scaling.mode(precision)
        self.static_scale = self.loss_scaling.static_scale if self.loss_scale_mode == "static" else None
        self.min_scale = self.loss_scaling.min_scale if self.loss_scale_mode == "dynamic" else None
        self.scaler = scaler if scaler is not None else self.loss_scaling.make_scaler(precision, scaler_device)

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        """The loss scaler every unscale, step and update goes through (``None``: no loss scaling)."""
        return self._scaler

    @scaler.setter
    def scaler(self, scaler: torch.amp.GradScaler | None) -> None:
        """Assigning a scaler (Lightning's tests wrap it in a ``Mock``; a user may bring a subclass) replaces it
        everywhere, the per-optimizer bookkeeping and its step hooks included."""
        self._scaler = scaler
        steps = getattr(self, "_steps", None)
        if scaler is None:
            if steps is not None:
                steps.release()
            self._steps = None
        elif steps is None:
            self._steps = ScalerBookkeeping(scaler)
        else:
            steps.scaler = scaler

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype autocast computes in: the real one, also on CPU (fp32 when ``"auto"`` chose no autocast)."""
        if self.precision == "auto":
            raise RuntimeError(
                "AMPPrecision('auto') has not chosen a precision yet: it does so when the Trainer's device is known"
                " (at setup). Call plugin.resolve(device) first to ask what it would choose."
            )
        return dtype_of_precision(self.precision)

    def loss_scale_state(self) -> LossScaleState:
        """Scale and step counters after the latest optimizer step (scale 1.0 when not scaling)."""
        scale = self.scaler.get_scale() if self.scaler is not None else 1.0
        return self._tracker.snapshot(scale)

    # -- set-up: device, precision choice, dtype checks, optimizer hooks ----------------------------------

    def resolve(self, device: torch.device | str) -> None:
        """Fix the device and, under ``"auto"``, choose the precision for it (once) and say why.

        The package's model transform calls this before it quantizes (QLoRA's compute dtype follows the
        choice); with any other strategy ``convert_module`` does. Later calls change nothing.
        It also applies ``float32_matmul_precision``, which ``teardown`` restores, and says once that fp16 on a
        CPU is slow (``cpu_fp16_note``).
        """
        device = torch.device(device)
        if self.device is None:
            self.device = device.type
        if self.precision == "auto":
            self.choice = choose_precision(device)
            self._configure(self.choice.precision, device.type)
            unused = self.loss_scaling.changed_settings()
            note = f" The loss-scale settings ({unused}) apply only when it chooses '16-mixed'." if unused else ""
            rank_zero_info(self.choice.describe() + note)
        if self.precision == "16-mixed" and device.type == "cpu" and not self._noted_cpu_fp16:
            self._noted_cpu_fp16 = True
            note = cpu_fp16_note()
            if note is not None:
                rank_zero_info(note)
        if self.float32_matmul_precision is not None and self._matmul_precision_before is None:
            self._matmul_precision_before = torch.get_float32_matmul_precision()
            torch.set_float32_matmul_precision(self.float32_matmul_precision)

    def convert_module(self, module: nn.Module) -> nn.Module:
        """Runs in ``strategy.setup`` before optimizers exist: resolve the device and check dtypes."""
        trainer = getattr(module, "_trainer", None)
        self.resolve(trainer.strategy.root_device if trainer is not None else torch.device(self.device or "cpu"))
        if self.precision == "bf16-mixed":
            verify_bf16_support(torch.device(self.device))
        elif self.precision == "16-mixed":
            self._check_half_trainable(module)
        return module

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        """Autocast, except where ``"auto"`` chose fp32."""
        if self.precision == "32-true":
            yield
            return
        with self.autocast_context_manager():
            yield

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
        if self._steps is not None:
            self._steps.watch(optimizers)  # a previous fit that stopped mid-step leaves nothing behind
            if self.skip_scheduler_on_overflow:
                guard_step_schedulers(lr_schedulers, self.step_was_skipped)
        return super().connect(model, optimizers, lr_schedulers)

    def teardown(self) -> None:
        if self._steps is not None:
            self._steps.release()
        if self._matmul_precision_before is not None:
            torch.set_float32_matmul_precision(self._matmul_precision_before)
            self._matmul_precision_before = None
        super().teardown()

    def step_was_skipped(self, optimizer: Optimizer | LightningOptimizer) -> bool:
        """Whether the latest step of ``optimizer`` applied no update (overflow, or nothing to step). In manual
        optimization, hold a scheduler you step by hand with it: ``if not plugin.step_was_skipped(opt): sch.step()``."""
        return self._steps is not None and self._steps.step_was_skipped(optimizer)

    # -- the step ---------------------------------------------------------------------------------------

    @contextmanager
    def train_step_context(self) -> Generator[None, None, None]:
        """A training batch starts: the previous one's steps get their scale update (if a step came after its
        ``training_step``), and unscales that no step followed are forgotten. In manual optimization the batch's
        steps get theirs when its ``training_step`` returns: one ``scaler.update()`` per iteration, after every
        optimizer stepped, as in PyTorch's loop for several optimizers."""
        if self._steps is not None:
            if self._steps.stepped:
                self._update_scale()
            self._steps.forget_unscales()
        with super().train_step_context():
            yield
        if self._steps is not None and self._steps.stepped:
            self._update_scale()

    def pre_backward(self, tensor: torch.Tensor, module: pl.LightningModule) -> torch.Tensor:  # type: ignore[override]
        steps = self._steps
        if steps is not None:
            if steps.all_stepped():  # every optimizer stepped: this backward starts the next iteration
                self._update_scale()
            # An optimizer unscaled (by a clip) whose gradients were zeroed since gets fresh scaled ones now.
            steps.forget_unscales(only_without_gradients=True)
            self._backwards += 1
        return super().pre_backward(tensor, module)

    def backward(  # type: ignore[override]
        self,
        tensor: torch.Tensor,
        model: pl.LightningModule,
        optimizer: Optimizer | LightningOptimizer | None,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        """Where the loss is scaled, an overflow is the scaler's to skip, under ``detect_anomaly=True`` too
        (``anomaly_mode.py``)."""
        with overflows_left_to_the_scaler(self):
            super().backward(tensor, model, optimizer, *args, **kwargs)

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: Optimizer,
        model: pl.LightningModule,
        closure: Callable[[], Any],
        **kwargs: Any,
    ) -> Any:
        steps = self._steps
        if steps is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        if closure_result is None and model.automatic_optimization and not has_gradients(optimizer):
            # ``training_step`` returned None and no earlier micro-batch of the window left gradients: there is
            # nothing to unscale or apply. Not a step, not an overflow; step-interval schedulers hold.
            self._after_closure(model, optimizer)
            steps.mark_skipped(optimizer)
            return closure_result
        try:
            self._unscale_once(optimizer)
            self._after_closure(model, optimizer)
            output, skipped = steps.step(optimizer, self._backwards, **kwargs)
        except BaseException:
            steps.forget_unscale(optimizer)  # the scaler must not keep a half-done step into the next one
            raise
        self._tracker.record(skipped, optimizer=steps.number(optimizer))
        if model.automatic_optimization:
            self._update_scale()  # one optimizer, one step per window; manual optimization: train_step_context
        return output

    def _unscale_once(self, optimizer: Optimizer | LightningOptimizer) -> None:
        """Unscale ``optimizer``'s gradients unless done since the last update. An optimizer that already stepped
        since then is stepped again within one ``training_step``: that is a new iteration, so update first (as
        a plain loop must: GradScaler steps an optimizer once per update)."""
        steps = self._steps
        if steps.has_stepped(optimizer):
            stepped_at = steps.stepped[id(unwrap(optimizer))]
            before = self.scaler.get_scale()
            self._update_scale()
            if self._backwards > stepped_at and self.scaler.get_scale() != before:
                self._warn_scale_changed_after_backward(optimizer, before)
        steps.unscale_once(optimizer)

    def _update_scale(self) -> None:
        """``scaler.update()`` for the steps since the last one; a skipped step among them is a back-off."""
        skipped = self._steps.update(new_scale=self.static_scale if self.loss_scale_mode == "static" else None)
        if skipped:
            self._tracker.record_backoff(self.scaler.get_scale())
            self._check_min_scale()

    def _warn_scale_changed_after_backward(self, optimizer: Optimizer | LightningOptimizer, before: float) -> None:
        rank_zero_warn(
            f"{type(unwrap(optimizer)).__name__} stepped twice in one training_step with a backward in between,"
            " while another optimizer had not stepped yet: the loss scale update between its two steps came after"
            f" that backward and changed the scale ({before:g} -> {self.scaler.get_scale():g}), so gradients"
            " scaled with the old scale were unscaled with the new one. Step every optimizer before the next"
            " backward, or each optimizer at most once per training_step.",
            category=RuntimeWarning,
        )

    def clip_gradients(
        self,
        optimizer: Optimizer,
        clip_val: int | float | None = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Lightning's order: disabled clipping returns before anything is read; an optimizer that unscales
        inside its own step is refused before anything is unscaled; otherwise the clip (which unscales first)."""
        if clip_val is None or clip_val <= 0:
            return
        if optimizer_handles_unscaling(optimizer):
            raise RuntimeError(
                f"The current optimizer, {type(optimizer).__qualname__}, does not allow for gradient clipping"
                " because it performs unscaling of gradients internally. HINT: Are you using a 'fused' optimizer?"
            )
        super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    # Manual optimization clips before ``optimizer.step()``: the clip unscales (once) so that the threshold means
    # the same as in automatic optimization, where the step unscaled before clipping.
    def clip_grad_by_value(self, optimizer: Optimizer, clip_val: int | float) -> None:
        if self._steps is not None:
            self._unscale_once(optimizer)
        super().clip_grad_by_value(optimizer, clip_val)

    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: int | float) -> None:
        if self._steps is not None:
            self._unscale_once(optimizer)
        super().clip_grad_by_norm(optimizer, clip_val)

    def _check_min_scale(self) -> None:
        scale = self.scaler.get_scale()
        if self.min_scale is None or scale >= self.min_scale:
            return
        t = self._tracker
        optimizers = self._steps.optimizer_count
        in_a_row = steps_in_a_row(t.consecutive_overflows, t.consecutive_overflows_optimizer, optimizers)
        raise LossScaleCollapseError(
            f"The loss scale fell to {scale:g}, below min_scale={self.min_scale:g}: the gradients held inf/NaN"
            f" on {in_a_row} ({t.skipped_steps} of {t.optimizer_steps} steps skipped in all). Recent back-offs:"
            f" {t.describe_history()}."
            " Usual causes: a NaN in the data or the loss, a diverging learning rate, or activations beyond"
            " fp16's range (max 65504). Fixes: check the loss for NaN, lower the learning rate, use"
            " AMPPrecision('bf16-mixed') where the hardware has bf16, or lower min_scale."
        )

    # -- checkpoints ------------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        scaler_state = self.scaler.state_dict() if self.scaler is not None else {}
        return {
            "scaler": scaler_state,
            "tracker": self._tracker.state_dict(),
            "precision": self.precision,
            "requested_precision": self.requested_precision,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Accepts this plugin's state and a bare GradScaler state (Lightning's ``MixedPrecision``). The scale and
        the growth tracker resume; the growth settings are this run's (warned when the checkpoint's differ)."""
        if "tracker" in state_dict:
            self._tracker.load_state_dict(state_dict["tracker"])
        self._warn_if_precision_changed(state_dict.get("precision"))
        scaler_state = state_dict.get("scaler", state_dict if "scale" in state_dict else {})
        if self.scaler is None or not scaler_state:
            return
        if self.loss_scale_mode == "static":
            scaler_state = {**scaler_state, "scale": self.static_scale}
        else:
            saved = scaler_state
            scaler_state, changed = resumed_scaler_state(saved, self.scaler)
            if changed:
                self._warn_settings_changed(saved, scaler_state, changed)
        self.scaler.load_state_dict(scaler_state)

    def _warn_settings_changed(
        self, saved: dict[str, Any], resumed: dict[str, Any], changed: dict[str, tuple[Any, Any]]
    ) -> None:
        """This run's loss-scale settings win over the checkpoint's, as every other argument of the run does
        (YAML, CLI); said once, with the arguments that would keep the checkpoint's."""
        given = ", ".join(f"{name}={mine!r} (checkpoint: {old!r})" for name, (old, mine) in changed.items())
        keep = ", ".join(f"{name}={old!r}" for name, (old, _) in changed.items())
        tracker = saved.get("_growth_tracker", 0)
        if resumed.get("_growth_tracker", 0) != tracker:
            tracker = f"{tracker}, past the new growth_interval: the scale grows after the next overflow-free step"
        rank_zero_warn(
            f"Resuming AMPPrecision with loss-scale settings other than the checkpoint's: {given}. This run's"
            f" apply; the scale ({saved['scale']:g}) and the growth tracker (overflow-free steps: {tracker})"
            f" continue from the checkpoint. To keep the checkpoint's settings, pass AMPPrecision({keep})."
        )

    def _warn_if_precision_changed(self, recorded: str | None) -> None:
        if recorded is None or recorded == self.precision:
            return
        why = f" ({self.choice.reason})" if self.choice is not None else ""
        scaler = ""
        if recorded == "16-mixed" and self.scaler is None:
            scaler = " The checkpoint's loss-scaler state is not used."
        elif recorded != "16-mixed" and self.scaler is not None:
            scaler = f" The loss scaler starts afresh at {self.scaler.get_scale():g}."
        rank_zero_warn(
            f"This checkpoint was trained with precision {recorded!r}; this run uses {self.precision!r}{why}."
            f" Training continues from the same fp32 weights, but the numerics differ.{scaler} To keep"
            f" {recorded!r}, pass AMPPrecision({recorded!r})."
        )

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # A checkpoint written with Trainer(precision="16-mixed") stores the scaler under "MixedPrecision".
        if type(self).__qualname__ not in checkpoint and MixedPrecision.__qualname__ in checkpoint:
            self.load_state_dict(checkpoint[MixedPrecision.__qualname__])
