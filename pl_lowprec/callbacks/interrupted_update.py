"""Whether an exception came while an optimizer was updating the parameters: the weights are then those of no step.

An exception raised inside ``optimizer.step`` after the update began (a Ctrl-C during a foreach AdamW, an
optimizer or a kernel failing part way) leaves some parameters and optimizer states at the new step and the rest
at the old one. A checkpoint written then would be resumed as exact. Lightning cannot tell: it counts the step only
once the strategy's ``optimizer_step`` returned, and an exception before that looks like one before the step.

``UpdateWatch`` follows each training optimizer with torch's step hooks. The update begins where torch's
``step`` is entered without a closure (GradScaler, or manual optimization, steps it after the closure ran), or
where the closure it was handed returns (Lightning's plain precision passes ``training_step`` and ``backward`` as
the closure, which ``step`` runs first: an exception in there is one before the update). It ends where Lightning's
``LightningOptimizer`` ran its after-step slot (automatic optimization: the loss scale updated too,
``step_completion.py``), or where torch's ``step`` returned (manual optimization, whose loop resets that slot).
torch's hooks are registered only where a callback saves on an exception; the after-step slot always, for
``finish_the_step``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from pl_lowprec.callbacks.step_completion import on_each_optimizer_step


class UpdateWatch:
    """The current batch's optimizer step: whether it ``stepped`` (Lightning's step finished) and, where
    ``follow_updates`` hooked the optimizers, whether an update is ``interrupted`` (begun, not finished)."""

    def __init__(self) -> None:
        self.begun = False  # an update of the parameters began in the current step
        self.stepped = False  # the current step finished (automatic: Lightning's after-step slot ran)
        self._handles: list[RemovableHandle] = []  # torch's step hooks, while follow_updates holds them

    @property
    def interrupted(self) -> bool:
        return self.begun and not self.stepped

    def follow_steps(self, trainer: pl.Trainer) -> None:
        """Note where each of Lightning's steps ends (automatic optimization: ``finish_the_step`` needs it). Once
        per fit: the fit's ``LightningOptimizer`` objects are new."""
        if trainer.lightning_module.automatic_optimization:
            on_each_optimizer_step(trainer, self._after_lightning_step)

    def follow_updates(self, trainer: pl.Trainer) -> None:
        """torch's step hooks on the training's optimizers, once: where an update begins (and, under manual
        optimization, where it ends). Only a callback that saves on an exception needs them: they wrap each step's
        closure."""
        if self._handles:
            return
        automatic = trainer.lightning_module.automatic_optimization
        for optimizer in trainer.optimizers:
            self._handles.append(optimizer.register_step_pre_hook(self._before_step))
            if not automatic:
                self._handles.append(optimizer.register_step_post_hook(self._after_torch_step))

    def new_batch(self) -> None:
        self.begun = self.stepped = False

    def release(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _before_step(self, optimizer: Optimizer, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict] | None:
        """torch's step pre-hook; ``args`` begins with the optimizer (``self``), then a positional closure."""
        self.begun = self.stepped = False
        closure = kwargs.get("closure", args[1] if len(args) > 1 else None)
        if closure is None:
            self.begun = True
            return None
        wrapped = self._update_begins_after(closure)
        if "closure" in kwargs:
            return args, {**kwargs, "closure": wrapped}
        return (args[0], wrapped, *args[2:]), kwargs

    def _update_begins_after(self, closure: Callable[[], Any]) -> Callable[[], Any]:
        def closure_then_update() -> Any:
            result = closure()
            self.begun = True
            return result

        return closure_then_update

    def _after_torch_step(self, optimizer: Optimizer, args: tuple, kwargs: dict[str, Any]) -> None:
        self.stepped = True

    def _after_lightning_step(self) -> None:
        self.stepped = True
