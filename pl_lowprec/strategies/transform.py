"""The one place where a model is transformed, shared by ``LowPrecisionStrategy`` and its DDP twin.

Where it runs, in ``Trainer._run`` order:

1. ``strategy.connect(model)``, ``setup`` hooks, ``LightningModule.configure_model``;
2. restoring weights from ``ckpt_path`` (``strategy.load_model_state_dict``): **the transform runs here first**
   when resuming, so a checkpoint of the transformed model loads into a transformed model;
3. ``strategy.setup``: **the transform runs here** otherwise, before the precision plugin's
   ``convert_module``, the move to the device, the DDP wrapper and ``configure_optimizers``;
4. restoring optimizer, scheduler and precision state, then the loops.

``apply`` is idempotent, derived from the model itself (a checkpointed block is recognisable), so a second
``fit``, or ``validate`` after ``fit``, changes nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from pl_lowprec.checkpointing import (
    CheckpointImpl,
    CheckpointPolicy,
    is_checkpointed,
    set_activation_checkpointing,
    validate_checkpoint_args,
)


@dataclass
class ModelTransform:
    """What the strategy does to the model; validated when the strategy is built."""

    activation_checkpointing: CheckpointPolicy | None = None
    checkpoint_every_n: int = 1
    checkpoint_impl: CheckpointImpl = "non_reentrant"

    def __post_init__(self) -> None:
        validate_checkpoint_args(self.checkpoint_every_n, self.checkpoint_impl)

    def apply(self, model: nn.Module) -> None:
        if self.activation_checkpointing is None:
            return
        already = sum(is_checkpointed(m) for m in model.modules())
        names = set_activation_checkpointing(
            model, self.activation_checkpointing, self.checkpoint_every_n, self.checkpoint_impl
        )
        if not already:
            shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
            rank_zero_info(f"Activation checkpointing ({self.checkpoint_impl}) on {len(names)} blocks: {shown}")
