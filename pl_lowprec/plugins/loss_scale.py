"""Loss-scale bookkeeping: the counters behind ``AMPPrecision.loss_scale_state()``.

``torch.amp.GradScaler`` skips an optimizer step silently when the gradients overflow. The tracker here
records the outcome of every optimizer step, so that the plugin, the callbacks and the user can see how many
steps were skipped and how the scale moved, and so that a collapsing scale stops the run with its history
instead of grinding on at 1e-30.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

HISTORY_LENGTH = 16


@dataclass(frozen=True)
class LossScaleState:
    """A snapshot of the loss scaler after the latest optimizer step.

    ``overflows`` counts optimizer steps whose gradients held inf or NaN, ``skipped_steps`` those that were
    not applied. Under a loss scaler every overflow skips its step, so the two are equal; they are kept apart
    because they answer different questions (is the model healthy, did my update happen).

    ``consecutive_overflows`` counts in one optimizer's own steps, as GradScaler decides found-inf per optimizer
    under its one scale: the longest run of skipped steps that any optimizer is on now, and
    ``consecutive_overflows_optimizer`` its index in ``configure_optimizers``' order. With two optimizers, one that
    skips every step while the other applies is ``n`` steps into a run after ``n`` batches (a count across
    optimizers read 1, 0, 1, 0 and never stopped it); both skipping every step is ``n`` too, not ``2n``.
    """

    scale: float
    overflows: int
    skipped_steps: int
    consecutive_overflows: int
    last_step_skipped: bool
    optimizer_steps: int = 0  # steps the scaler saw, applied or skipped (not a training_step that returned None)
    consecutive_overflows_optimizer: int | None = None  # whose run consecutive_overflows is (None: no run)


def steps_in_a_row(count: int, optimizer: int | None, optimizers: int) -> str:
    """``"3 optimizer steps in a row"``, naming the optimizer where there are several (each counts its own)."""
    if optimizers > 1 and optimizer is not None:
        return f"{count} steps in a row of optimizer {optimizer} (of {optimizers}, each counted in its own steps)"
    return f"{count} optimizer steps in a row"


class LossScaleCollapseError(RuntimeError):
    """Raised when dynamic loss scaling backs off below ``min_scale``: the gradients overflow at every scale."""


@dataclass
class LossScaleTracker:
    """Counts step outcomes, the current run of skipped steps of each optimizer, and remembers recent scale
    back-offs as ``(optimizer_step, new_scale)``."""

    optimizer_steps: int = 0
    overflows: int = 0
    skipped_steps: int = 0
    last_step_skipped: bool = False
    backoffs: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=HISTORY_LENGTH))
    runs: dict[int, int] = field(default_factory=dict)  # optimizer index -> its skipped steps in a row now

    @property
    def consecutive_overflows(self) -> int:
        """The longest current run of skipped steps of one optimizer (in that optimizer's steps)."""
        return max(self.runs.values(), default=0)

    @property
    def consecutive_overflows_optimizer(self) -> int | None:
        """The optimizer whose run ``consecutive_overflows`` is (the first of equal runs); ``None`` without one."""
        longest = self.consecutive_overflows
        return min(i for i, run in self.runs.items() if run == longest) if longest else None

    def record(self, skipped: bool, scale: float | None = None, optimizer: int = 0) -> None:
        """Record one step of optimizer number ``optimizer``; ``scale`` is the scale after a skipped step's
        back-off, when known now."""
        self.optimizer_steps += 1
        self.last_step_skipped = skipped
        if not skipped:
            self.runs[optimizer] = 0
            return
        self.overflows += 1
        self.skipped_steps += 1
        self.runs[optimizer] = self.runs.get(optimizer, 0) + 1
        if scale is not None:
            self.record_backoff(scale)

    def record_backoff(self, scale: float) -> None:
        """Record the scale a back-off left, at the latest step: the scale update may come after the steps it
        follows (several optimizers update once, after all of them stepped)."""
        self.backoffs.append((self.optimizer_steps, scale))

    def snapshot(self, scale: float) -> LossScaleState:
        return LossScaleState(
            scale=scale,
            overflows=self.overflows,
            skipped_steps=self.skipped_steps,
            consecutive_overflows=self.consecutive_overflows,
            last_step_skipped=self.last_step_skipped,
            optimizer_steps=self.optimizer_steps,
            consecutive_overflows_optimizer=self.consecutive_overflows_optimizer,
        )

    def describe_history(self) -> str:
        """Human-readable recent back-offs, oldest first: ``step 3 -> 32768, step 4 -> 16384``."""
        if not self.backoffs:
            return "no back-offs recorded"
        return ", ".join(f"step {step} -> {scale:g}" for step, scale in self.backoffs)

    def state_dict(self) -> dict[str, Any]:
        return {
            "optimizer_steps": self.optimizer_steps,
            "overflows": self.overflows,
            "skipped_steps": self.skipped_steps,
            "consecutive_overflows": self.consecutive_overflows,
            "consecutive_by_optimizer": sorted(self.runs.items()),
            "last_step_skipped": self.last_step_skipped,
            "backoffs": list(self.backoffs),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer_steps = int(state.get("optimizer_steps", 0))
        self.overflows = int(state.get("overflows", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        # A checkpoint from before the per-optimizer count holds one run: optimizer 0's.
        runs = state.get("consecutive_by_optimizer", [(0, state.get("consecutive_overflows", 0))])
        self.runs = {int(optimizer): int(run) for optimizer, run in runs}
        self.last_step_skipped = bool(state.get("last_step_skipped", False))
        pairs = ((int(step), float(scale)) for step, scale in state.get("backoffs", ()))
        self.backoffs = deque(pairs, maxlen=HISTORY_LENGTH)
