"""The one place where a model is transformed, shared by ``LowPrecisionStrategy`` and its DDP twin.

What it does, in order: quantize the base ``nn.Linear`` layers (bitsandbytes), inject LoRA adapters (peft)
and prepare them for the precision, then checkpoint activations. After ``configure_optimizers`` it may swap
the optimizer for a bitsandbytes one. With LoRA, checkpoints hold only the trainable weights.

Where it runs, in ``Trainer._run`` order:

1. ``strategy.connect(model)``, ``setup`` hooks, ``LightningModule.configure_model``;
2. restoring weights from ``ckpt_path`` (``strategy.load_model_state_dict``): **the model transform runs here
   first** when resuming, so an adapter checkpoint loads into a freshly quantized, adapted model;
3. ``strategy.setup``: **the model transform runs here** otherwise, before the precision plugin's
   ``convert_module``, the move to the device, the DDP wrapper and ``configure_optimizers``; **the optimizer
   swap** runs right after ``configure_optimizers``, before the precision plugin connects to the optimizers;
4. restoring optimizer, scheduler and precision state, then the loops.

``apply`` is idempotent, derived from the model itself (quantized layers, LoRA layers and checkpointed blocks
are recognisable), so a second ``fit``, or ``validate`` after ``fit``, changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.optim import Optimizer

from pl_lowprec._imports import import_bitsandbytes, import_peft
from pl_lowprec.adapters import load_trainable_state_dict, trainable_state_dict
from pl_lowprec.checkpointing import (
    CheckpointImpl,
    CheckpointPolicy,
    is_checkpointed,
    set_activation_checkpointing,
    validate_checkpoint_args,
)
from pl_lowprec.lora import has_lora, inject_lora, lora_config, prepare_for_kbit_training
from pl_lowprec.optimizers import OptimizerName, rebind_schedulers, swap_optimizer, validate_optimizer_name
from pl_lowprec.quantization import DEFAULT_SKIP, QuantizationConfig, QuantMode, quantize_model

_DTYPE_BY_PRECISION = {
    "16-mixed": torch.float16,
    "bf16-mixed": torch.bfloat16,
    "16-true": torch.float16,
    "bf16-true": torch.bfloat16,
    "32-true": torch.float32,
    "64-true": torch.float64,
}


def dtype_of_precision(precision: str) -> torch.dtype:
    """The compute dtype of a Trainer precision string (``"bf16-mixed"`` -> bfloat16, unknown -> float32)."""
    return _DTYPE_BY_PRECISION.get(str(precision), torch.float32)


def compute_dtype_of(precision_plugin: Any) -> torch.dtype:
    """The dtype a precision plugin computes in: its own ``compute_dtype``, else from its precision string."""
    own = getattr(precision_plugin, "compute_dtype", None)
    if isinstance(own, torch.dtype):
        return own
    return dtype_of_precision(precision_plugin.precision)


@dataclass
class ModelTransform:
    """What the strategy does to the model; every argument is validated when the strategy is built."""

    activation_checkpointing: CheckpointPolicy | None = None
    checkpoint_every_n: int = 1
    checkpoint_impl: CheckpointImpl = "non_reentrant"
    quantization: QuantMode | QuantizationConfig | None = None
    lora: Mapping[str, Any] | Any | None = None
    optimizer: OptimizerName | None = None
    adapter_only_checkpoint: bool = True

    def __post_init__(self) -> None:
        validate_checkpoint_args(self.checkpoint_every_n, self.checkpoint_impl)
        if isinstance(self.quantization, str):
            self.quantization = QuantizationConfig.from_mode(self.quantization)
        if self.quantization is not None:
            import_bitsandbytes()
        if self.optimizer is not None:
            validate_optimizer_name(self.optimizer)
            import_bitsandbytes()
        if self.lora is not None:
            import_peft()
            self.lora = lora_config(self.lora)

    @property
    def skip_modules(self) -> tuple[str, ...]:
        return tuple(self.quantization.skip_modules) if self.quantization is not None else DEFAULT_SKIP

    def apply(self, model: nn.Module, precision_plugin: Any, device: torch.device) -> None:
        if hasattr(precision_plugin, "resolve"):  # AMPPrecision("auto") chooses for the device before quantizing
            precision_plugin.resolve(device)
        compute_dtype = compute_dtype_of(precision_plugin)
        if self.quantization is not None:
            replaced = quantize_model(model, self.quantization, compute_dtype, device)
            if replaced:
                rank_zero_info(f"Quantized {len(replaced)} linear layers to {self.quantization.mode}.")
        if self.lora is not None and not has_lora(model):
            adapted = inject_lora(model, self.lora, self.skip_modules)
            mixed = str(precision_plugin.precision).endswith("-mixed")
            added = prepare_for_kbit_training(model, mixed_precision=mixed)
            if added:
                rank_zero_info(f"Upcast trainable and norm weights to fp32 for mixed precision (+{added} bytes).")
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            rank_zero_info(f"LoRA on {len(adapted)} layers; {trainable} trainable parameters.")
        if self.activation_checkpointing is not None:
            already = any(is_checkpointed(m) for m in model.modules())
            names = set_activation_checkpointing(
                model, self.activation_checkpointing, self.checkpoint_every_n, self.checkpoint_impl
            )
            if not already:
                shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
                rank_zero_info(f"Activation checkpointing ({self.checkpoint_impl}) on {len(names)} blocks: {shown}")

    def swap_optimizers(self, optimizers: list[Optimizer], lr_scheduler_configs: list[Any], device: torch.device):
        """Replace each optimizer by its bitsandbytes equivalent, re-binding its schedulers."""
        if self.optimizer is None:
            return optimizers
        swapped = []
        for old in optimizers:
            new = swap_optimizer(old, self.optimizer, device)
            rebind_schedulers(lr_scheduler_configs, old, new)
            swapped.append(new)
        return swapped

    @property
    def adapter_only(self) -> bool:
        return self.lora is not None and self.adapter_only_checkpoint

    def state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        return trainable_state_dict(model) if self.adapter_only else model.state_dict()

    def load_state_dict(self, model: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool) -> None:
        if self.adapter_only:
            load_trainable_state_dict(model, state_dict, strict=strict)
        else:
            model.load_state_dict(state_dict, strict=strict)
