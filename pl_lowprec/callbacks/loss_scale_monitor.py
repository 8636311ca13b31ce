"""``LossScaleMonitor``: logs loss-scale health, warns once, stops on persistent overflow, names the culprit.

It reads ``AMPPrecision.loss_scale_state()``; for Lightning's own ``MixedPrecision`` and ``FSDPPrecision`` it
reads their ``scaler`` and counts skipped steps itself, seeing which optimizer steps the scaler let through
(``step_outcomes.py``). Without a scaler (bf16, fp32) it watches the loss and the gradient norm for non-finite
values instead.
"""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from pl_lowprec.callbacks.logger_step import last_training_step_logged
from pl_lowprec.callbacks.overflow_locator import OverflowLocation, OverflowLocator
from pl_lowprec.callbacks.step_outcomes import StepOutcomes
from pl_lowprec.plugins.loss_scale import LossScaleState, LossScaleTracker, steps_in_a_row

RANKS_MAY_DISAGREE = (
    "LossScaleMonitor: Lightning's MixedPrecision decides on each of the {world_size} processes alone whether a step"
    " overflowed. An inf that reaches one rank's gradients after DDP's all-reduce (a gradient hook, a fault) skips"
    " the step there only: the replicas part, the values logged are rank zero's, and locating the overflow waits"
    " for ranks that saw none. Use pl_lowprec.AMPPrecision('16-mixed'), whose ranks agree on every overflow."
)


def ranks_may_disagree_on_overflow(trainer: pl.Trainer) -> bool:
    """Several processes with Lightning's fp16 ``MixedPrecision``, whose GradScaler reduces nothing across ranks
    (``AMPPrecision`` all-reduces its found-inf; ``FSDPPrecision``'s ShardedGradScaler does too)."""
    plugin = trainer.precision_plugin
    return trainer.world_size > 1 and type(plugin) is MixedPrecision and getattr(plugin, "scaler", None) is not None


class PersistentOverflowError(RuntimeError):
    """Raised after ``max_consecutive_overflows`` optimizer steps in a row had non-finite gradients."""


class LossScaleMonitor(pl.Callback):
    """Logs ``loss_scale/*`` metrics every optimizer step and guards against runs that stopped learning.

    Args:
        window: Optimizer steps over which ``loss_scale/skip_rate`` is computed.
        warn_skip_rate: Warn once when the skip rate over a full window exceeds this.
        warn_scale_below: Warn once when the loss scale falls below this.
        max_consecutive_overflows: Stop with ``PersistentOverflowError`` after this many overflowing steps in a
            row of one optimizer (each optimizer counts its own steps: one that skips every step stops the run even
            while another applies). ``None`` never stops.
        locate_overflow: After an overflow, hook every module for one step to find where the first non-finite
            value appears (module, forward or backward, dtype). No hooks run on healthy steps.
        check_gradients: Without a loss scaler, check the gradient norm for inf/NaN before each step.
        print_summary: Print a one-line summary at the end of fit (rank zero).
    """

    def __init__(
        self,
        window: int = 100,
        warn_skip_rate: float = 0.1,
        warn_scale_below: float = 1.0,
        max_consecutive_overflows: int | None = 25,
        locate_overflow: bool = True,
        check_gradients: bool = True,
        print_summary: bool = True,
    ) -> None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"LossScaleMonitor(window={window!r}) must be an integer >= 1.")
        if not 0.0 <= warn_skip_rate <= 1.0:
            raise ValueError(f"LossScaleMonitor(warn_skip_rate={warn_skip_rate!r}) must be between 0 and 1.")
        if not math.isfinite(warn_scale_below) or warn_scale_below < 0:
            raise ValueError(
                f"LossScaleMonitor(warn_scale_below={warn_scale_below!r}) must be a finite number >= 0 (0: never"
                " warn; the default 1.0 warns when fp16 gradients are no longer scaled up)."
            )
        if max_consecutive_overflows is not None and max_consecutive_overflows < 1:
            raise ValueError(
                f"LossScaleMonitor(max_consecutive_overflows={max_consecutive_overflows!r}) must be >= 1,"
                " or None to never stop."
            )
        self.window = window
        self.warn_skip_rate = warn_skip_rate
        self.warn_scale_below = warn_scale_below
        self.max_consecutive_overflows = max_consecutive_overflows
        self.locate_overflow = locate_overflow
        self.check_gradients = check_gradients
        self.print_summary = print_summary
        self.last_location: OverflowLocation | None = None
        self.growths = 0
        self.empty_steps = 0  # steps Lightning counted that applied nothing (training_step returned None)
        self.backoffs = 0
        self._recent: deque[bool] = deque(maxlen=window)
        self._own_tracker = LossScaleTracker()  # for plugins that keep no counts (Lightning's, or no scaler)
        self._outcomes = StepOutcomes()  # the steps Lightning's scaler applied or skipped
        self._previous: LossScaleState | None = None
        self._seen_step = 0
        self._nonfinite: torch.Tensor | None = None  # device flag: no host sync until the step ends
        self._warned: set[str] = set()
        self._locator = OverflowLocator()
        self._rearm_after_validation = False

    # -- where the state comes from ---------------------------------------------------------------------

    @staticmethod
    def _scaler(trainer: pl.Trainer) -> Any:
        return getattr(trainer.precision_plugin, "scaler", None)

    def _read_state(self, trainer: pl.Trainer, scaler: Any, steps: int) -> LossScaleState:
        if self._outcomes.watching:  # Lightning's plugins: the steps their scaler let through, and whose
            scale = scaler.get_scale()
            for optimizer, applied in self._outcomes.take():
                self._own_tracker.record(not applied, scale, optimizer=optimizer)
            return self._own_tracker.snapshot(scale)
        if scaler is not None:  # AMPPrecision keeps its own counts
            return trainer.precision_plugin.loss_scale_state()
        overflows = int(self._nonfinite is not None and bool(self._nonfinite))  # one sync per optimizer step
        for i in range(steps):  # not known whose: the batch's last steps, each at its place in the batch
            self._own_tracker.record(i >= steps - overflows, 1.0, optimizer=i)
        return self._own_tracker.snapshot(1.0)

    # -- hooks ------------------------------------------------------------------------------------------

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.loggers:
            rank_zero_info(self._without_logger())
        if ranks_may_disagree_on_overflow(trainer):
            rank_zero_warn(RANKS_MAY_DISAGREE.format(world_size=trainer.world_size), category=RuntimeWarning)
        # After checkpoint restore: counts restored into AMPPrecision are history, not new overflows.
        self._seen_step = trainer.global_step
        plugin = trainer.precision_plugin
        scaler = self._scaler(trainer)
        self._outcomes.release()
        if scaler is not None and hasattr(plugin, "loss_scale_state"):
            self._previous = plugin.loss_scale_state()
        elif scaler is not None:  # Lightning's scaler: an overflow on the first step lowers it from this one
            self._previous = self._own_tracker.snapshot(scaler.get_scale())
            self._outcomes.watch(trainer.optimizers)
        else:
            self._previous = None

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        scaler = self._scaler(trainer)
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if scaler is None and isinstance(loss, torch.Tensor):
            self._flag_nonfinite(loss.detach())
        if pl_module.automatic_optimization and loss is None:
            self._outcomes.take()  # training_step returned None: Lightning's plugin stepped nothing through the scaler
        steps = trainer.global_step - self._seen_step
        if steps <= 0:
            return  # inside an accumulation window
        self._seen_step = trainer.global_step
        state = self._read_state(trainer, scaler, steps)
        previous = self._previous or state
        new_overflows = state.overflows - (self._previous.overflows if self._previous else 0)
        overflowed = new_overflows > 0
        self._recent.extend([False] * max(0, steps - new_overflows) + [True] * min(steps, new_overflows))
        if self._outcomes.watching:  # Lightning's plugins update after each step: every skip backed off once
            self.backoffs += new_overflows
            self.growths += growths_between(previous.scale, state.scale, new_overflows, scaler)
        elif scaler is not None:  # AMPPrecision updates the scale once a training_step
            self.backoffs += backoffs_between(previous.scale, state.scale, scaler.get_backoff_factor(), steps)
            self.growths += state.scale > previous.scale
        if self._previous is not None:  # AMPPrecision's count of the steps its scaler saw
            self.empty_steps += max(steps - (state.optimizer_steps - self._previous.optimizer_steps), 0)
        self._previous = state
        self._nonfinite = None

        if self._locator.armed:
            location = self._locator.location if overflowed else None
            if scaler is not None and trainer.world_size > 1:
                location = first_location_of_all_ranks(location, trainer.global_rank)
            if location is not None:
                self.last_location = location
            self._locator.disarm()
        pl_module.log_dict(self._metrics(trainer, state), on_step=True, on_epoch=False)
        self._check(trainer, state, overflowed)
        if overflowed and self.locate_overflow:
            self._locator.arm(pl_module)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A validation pass between the overflow and the next step would be located as the training step's
        # overflow (its forward runs through the same modules), and would pay for the checks.
        self._rearm_after_validation = self._locator.armed
        self._locator.disarm()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._rearm_after_validation:
            self._locator.arm(pl_module)
        self._rearm_after_validation = False

    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if self._outcomes.watching:
            self._outcomes.attempt(optimizer)
        if not self.check_gradients or self._scaler(trainer) is not None:
            return
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        if grads:
            self._flag_nonfinite(torch.nn.utils.get_total_norm(grads))

    def _flag_nonfinite(self, tensor: torch.Tensor) -> None:
        bad = ~torch.isfinite(tensor).all()
        self._nonfinite = bad if self._nonfinite is None else self._nonfinite | bad

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._locator.disarm()
        self._outcomes.release()
        if self._previous is None or not trainer.is_global_zero:
            return
        # Lightning passes self.log's values on only every log_every_n_steps-th step: the final counts, always
        metrics = self._metrics(trainer, self._previous)
        final = {name.replace("loss_scale/", "loss_scale/final/"): value for name, value in metrics.items()}
        for logger in trainer.loggers:
            logger.log_metrics(final, step=last_training_step_logged(trainer))
            logger.save()
        if self.print_summary:
            print(self.summary_line(trainer, self._previous))

    def summary_line(self, trainer: pl.Trainer, state: LossScaleState) -> str:
        steps = trainer.global_step - self.empty_steps
        where = f" First non-finite value: {self.last_location}." if self.last_location is not None else ""
        if self.empty_steps:
            where += f" {self.empty_steps} more steps applied nothing (training_step returned None)."
        if self._scaler(trainer) is None:
            applied = " or gradients, and the optimizer applied them" if state.overflows else ""
            return (
                f"Loss scale: none (no scaler); {state.overflows} of {steps} optimizer steps had a non-finite"
                f" loss{applied}.{where}"
            )
        return (
            f"Loss scale: {state.scale:g} at the end; {state.skipped_steps} of {steps} optimizer steps skipped for"
            f" overflow; {self.growths} growths, {self.backoffs} back-offs.{where}"
        )

    def _without_logger(self) -> str:
        totals = "the summary line at the end of fit gives the totals" if self.print_summary else "print_summary=False"
        return (
            "LossScaleMonitor: the Trainer has no logger (logger=False), so the loss_scale/* series is not recorded:"
            f" trainer.callback_metrics holds the latest values and {totals}. Pass a logger (CSVLogger,"
            " TensorBoardLogger) to keep the series."
        )

    # -- checkpoints: the counts go on where a resumed run starts -----------------------------------------

    def state_dict(self) -> dict[str, Any]:
        location = self.last_location
        return {
            "growths": self.growths,
            "empty_steps": self.empty_steps,
            "backoffs": self.backoffs,
            "recent": list(self._recent),
            "warned": sorted(self._warned),
            "own_tracker": self._own_tracker.state_dict(),
            "last_location": None
            if location is None
            else [location.module, location.phase, str(location.dtype), location.rank],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.growths = int(state_dict.get("growths", 0))
        self.empty_steps = int(state_dict.get("empty_steps", 0))
        self.backoffs = int(state_dict.get("backoffs", 0))
        self._recent = deque((bool(r) for r in state_dict.get("recent", ())), maxlen=self.window)
        self._warned = set(state_dict.get("warned", ()))
        self._own_tracker.load_state_dict(state_dict.get("own_tracker", {}))
        saved = state_dict.get("last_location")
        if saved:
            module, phase, dtype, rank = saved
            self.last_location = OverflowLocation(module, phase, getattr(torch, dtype.removeprefix("torch.")), rank)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        self._locator.disarm()
        self._outcomes.release()

    # -- reporting --------------------------------------------------------------------------------------

    @property
    def skip_rate(self) -> float:
        return sum(self._recent) / len(self._recent) if self._recent else 0.0

    def _metrics(self, trainer: pl.Trainer, state: LossScaleState) -> dict[str, float]:
        metrics = {
            "loss_scale/overflows": float(state.overflows),
            "loss_scale/skipped_steps": float(state.skipped_steps),
            "loss_scale/consecutive_overflows": float(state.consecutive_overflows),
            "loss_scale/skip_rate": self.skip_rate,
        }
        if self._scaler(trainer) is not None:
            metrics["loss_scale/scale"] = state.scale
            metrics["loss_scale/growths"] = float(self.growths)
            metrics["loss_scale/backoffs"] = float(self.backoffs)
        else:  # nothing was skipped: the optimizer applied these non-finite updates
            metrics["loss_scale/skipped_steps"] = 0.0
            metrics["loss_scale/skip_rate"] = 0.0
            metrics["loss_scale/nonfinite_steps"] = float(state.overflows)
            metrics["loss_scale/nonfinite_rate"] = self.skip_rate
        return metrics

    def _where(self) -> str:
        if self.last_location is not None:
            return f" The first non-finite value appeared at {self.last_location}."
        if self.locate_overflow:
            return " Its origin was not located yet (the hooks look at the step after an overflow)."
        return " Pass LossScaleMonitor(locate_overflow=True) to find the module that overflows."

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            rank_zero_warn(message, category=RuntimeWarning)

    def _check(self, trainer: pl.Trainer, state: LossScaleState, overflowed: bool) -> None:
        scaling = self._scaler(trainer) is not None
        if self.max_consecutive_overflows is not None and state.consecutive_overflows >= self.max_consecutive_overflows:
            if scaling:
                what = "had inf/NaN gradients and were skipped"
                counts = f"; scale {state.scale:g}, {state.skipped_steps} steps skipped in all"
                advice = "; AMPPrecision('bf16-mixed') avoids fp16's range limit where the hardware supports it."
            else:  # no scaler: nothing was skipped, and the run is not fp16
                what, counts = "had a non-finite loss or gradients, and the optimizer applied them", ""
                advice = "; the parameters may already hold NaN, so resume from a checkpoint before the first one."
            in_a_row = steps_in_a_row(
                state.consecutive_overflows, state.consecutive_overflows_optimizer, len(trainer.optimizers)
            )
            raise PersistentOverflowError(
                f"{in_a_row} {what}"
                f" (max_consecutive_overflows={self.max_consecutive_overflows}{counts}).{self._where()} Check that"
                f" module's inputs and dtype, the data for NaN, and the learning rate{advice}"
            )
        if overflowed and not scaling:
            self._warn_once(
                "nonfinite",
                f"A non-finite loss or gradient at step {trainer.global_step}: with no loss scaler the"
                f" optimizer applied it, so the parameters may now hold NaN.{self._where()}",
            )
        if scaling and state.scale < self.warn_scale_below:
            self._warn_once(
                "scale",
                f"The loss scale fell to {state.scale:g} (below {self.warn_scale_below:g}) at step"
                f" {trainer.global_step}: fp16 gradients are overflowing even unscaled.{self._where()}",
            )
        if len(self._recent) == self.window and self.skip_rate > self.warn_skip_rate:
            what = (
                "were skipped for overflow (threshold {:.0%}); these steps did not train"
                if scaling
                else "had a non-finite loss or gradients (threshold {:.0%}), and the optimizer applied them"
            )
            self._warn_once(
                "rate",
                f"{self.skip_rate:.0%} of the last {self.window} optimizer steps {what.format(self.warn_skip_rate)}."
                f"{self._where()}",
            )


def first_location_of_all_ranks(location: OverflowLocation | None, rank: int) -> OverflowLocation | None:
    """The location the lowest rank found, with its rank: an activation's inf stays on the rank whose batch made
    it (only gradients are all-reduced), and only rank zero warns. Called by every rank on the same steps (those
    after an overflow, which the all-reduced gradients make the same everywhere)."""
    if not (dist.is_available() and dist.is_initialized()):
        return location
    found: list[OverflowLocation | None] = [None] * dist.get_world_size()
    dist.all_gather_object(found, None if location is None else dataclasses.replace(location, rank=rank))
    return next((f for f in found if f is not None), None)


def growths_between(before: float, after: float, backoffs: int, scaler: Any) -> int:
    """How many growths took a dynamic scale from ``before`` to ``after`` past ``backoffs`` back-offs: a growth
    and a back-off in one batch (Lightning updates after each optimizer's step) leave the scale as it was."""
    growth, backoff = scaler.get_growth_factor(), scaler.get_backoff_factor()
    if not (before > 0 and after > 0 and growth > 1.0 and 0.0 < backoff < 1.0):
        return int(after > before)
    return max(round(math.log(after / (before * backoff**backoffs)) / math.log(growth)), 0)


def backoffs_between(before: float, after: float, backoff_factor: float, steps: int) -> int:
    """How many back-offs took ``AMPPrecision``'s dynamic scale from ``before`` to ``after`` over ``steps`` optimizer
    steps. It updates once a ``training_step``, so more than once a batch only where a manual ``training_step``
    steps one optimizer twice (an update comes between the two steps). At least one when it fell, at most one per
    step. (Lightning's plugins need no inference: their skips are seen, ``step_outcomes.py``.)"""
    if not after < before:
        return 0
    if not 0.0 < backoff_factor < 1.0:
        return 1
    return min(max(round(math.log(after / before) / math.log(backoff_factor)), 1), steps)
