"""A training-bar label that makes sense for runs limited by ``max_steps``.

Lightning's ``RichProgressBar`` labels the training bar ``Epoch {epoch}/{max_epochs - 1}``. A run limited by
``max_steps`` has ``max_epochs=-1``, so the quick-start read ``Epoch 0/-2``. This bar says
``Epoch 0 (max_steps=200)`` instead and is otherwise Lightning's. ``pl-lowprec`` uses it in place of the
default bar; pass it in ``callbacks`` to use it with a plain ``Trainer``.
"""

from __future__ import annotations

from lightning.pytorch.callbacks import RichProgressBar


class StepLimitedRichProgressBar(RichProgressBar):
    """``RichProgressBar`` whose training label names ``max_steps`` when the run has no epoch limit."""

    def _get_train_description(self, current_epoch: int) -> str:
        max_epochs = self.trainer.max_epochs
        if max_epochs is not None and max_epochs >= 0:
            return super()._get_train_description(current_epoch)
        description = f"Epoch {current_epoch} (max_steps={self.trainer.max_steps})"
        return f"{description:{len(self.validation_description)}}"
