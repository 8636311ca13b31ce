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
    """

    scale: float
    overflows: int
    skipped_steps: int
    consecutive_overflows: int
    last_step_skipped: bool
    optimizer_steps: int = 0  # steps the scaler saw, applied or skipped (not a training_step that returned None)


class LossScaleCollapseError(RuntimeError):
    """Raised when dynamic loss scaling backs off below ``min_scale``: the gradients overflow at every scale."""


@dataclass
class LossScaleTracker:
    """Counts step outcomes and remembers recent scale back-offs as ``(optimizer_step, new_scale)``."""

    optimizer_steps: int = 0
    overflows: int = 0
    skipped_steps: int = 0
    consecutive_overflows: int = 0
    last_step_skipped: bool = False
    backoffs: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=HISTORY_LENGTH))

    def record(self, skipped: bool, scale: float | None = None) -> None:
        """Record one optimizer step; ``scale`` is the scale after a skipped step's back-off, when known now."""
        self.optimizer_steps += 1
        self.last_step_skipped = skipped
        if not skipped:
            self.consecutive_overflows = 0
            return
        self.overflows += 1
        self.skipped_steps += 1
        self.consecutive_overflows += 1
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
            "last_step_skipped": self.last_step_skipped,
            "backoffs": list(self.backoffs),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer_steps = int(state.get("optimizer_steps", 0))
        self.overflows = int(state.get("overflows", 0))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.consecutive_overflows = int(state.get("consecutive_overflows", 0))
        self.last_step_skipped = bool(state.get("last_step_skipped", False))
        pairs = ((int(step), float(scale)) for step, scale in state.get("backoffs", ()))
        self.backoffs = deque(pairs, maxlen=HISTORY_LENGTH)
