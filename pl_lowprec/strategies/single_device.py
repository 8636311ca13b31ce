"""``LowPrecisionStrategy``: Lightning's single-device strategy plus the model transform (``"lowprec"``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.strategies.strategy import _StrategyRegistry

from pl_lowprec.strategies.transform_hooks import TransformHooks
from pl_lowprec.transforms.checkpointing import CheckpointImpl, CheckpointPolicy
from pl_lowprec.transforms.fp8 import FP8Config, FP8Recipe
from pl_lowprec.transforms.optimizers import OptimizerName
from pl_lowprec.transforms.pipeline import ModelTransform
from pl_lowprec.transforms.qat import QATConfig, QATScheme
from pl_lowprec.transforms.quantization import QuantizationConfig, QuantMode


class LowPrecisionStrategy(TransformHooks, SingleDeviceStrategy):
    """One device; transforms the model once per fit (see ``pl_lowprec.transforms.pipeline``).

    Args:
        activation_checkpointing: Blocks to recompute in backward: module classes, class names (YAML), or a
            callable ``(module, name) -> bool``.
        checkpoint_every_n: Checkpoint only every n-th selected block: less recompute, more memory.
        checkpoint_impl: ``"non_reentrant"`` (default) or ``"reentrant"``.
        quantization: Base-weight quantization: ``"nf4"``, ``"nf4-dq"``, ``"fp4"``, ``"fp4-dq"``, ``"int8"``,
            or a ``QuantizationConfig``.
        lora: LoRA adapters: a ``peft.LoraConfig`` or a dict of its fields (``target_modules`` defaults to
            ``"all-linear"``). Base weights are frozen.
        optimizer: Swap the configured AdamW for ``"adamw8bit"``, ``"paged_adamw8bit"``,
            ``"paged_adamw32bit"`` or ``"lion8bit"`` (bitsandbytes).
        adapter_only_checkpoint: With ``lora``, checkpoints hold only the trainable weights.
        pretrained: Weights for a module built on the meta device (in ``configure_model`` under
            ``pl_lowprec.loading.empty_weights()``, or under ``trainer.init_module()``): a ``.safetensors`` file,
            a sharded directory with ``model.safetensors.index.json``, or a Hugging Face model directory. Loaded
            tensor by tensor; layers to be quantized are quantized as they load.
        pretrained_prefix: Turns checkpoint keys into module keys: ``"model."`` prepends to every key (a Hugging
            Face model held as ``self.model``); ``{"model.": "net.model."}`` rewrites a prefix.
        qat: Quantization-aware training (torchao): ``"int8-dynamic-int4-weight"``, ``"int4-weight-only"``,
            ``"int8-weight-only"``, or a ``QATConfig`` (group size, skipped modules). Converts to the real
            quantized form at the end of fit.
        fp8: Float8 training of the linear layers (torchao; compute capability 8.9+): ``"tensorwise"``,
            ``"rowwise"``, ``"rowwise_with_gw_hp"``, or an ``FP8Config``.
        activation_offloading: Keep saved activations in host memory between forward and backward (CUDA).
        device: The device; ``None`` takes the Trainer's (``accelerator``/``devices``).
        accelerator, checkpoint_io, precision_plugin: As for ``SingleDeviceStrategy``.
    """

    strategy_name = "lowprec"

    def __init__(
        self,
        activation_checkpointing: CheckpointPolicy | None = None,
        checkpoint_every_n: int = 1,
        checkpoint_impl: CheckpointImpl = "non_reentrant",
        quantization: QuantMode | QuantizationConfig | None = None,
        lora: dict[str, Any] | None = None,
        optimizer: OptimizerName | None = None,
        adapter_only_checkpoint: bool = True,
        pretrained: str | Path | None = None,
        pretrained_prefix: str | dict[str, str] | None = None,
        qat: QATScheme | QATConfig | None = None,
        fp8: FP8Recipe | FP8Config | None = None,
        activation_offloading: bool = False,
        device: str | torch.device | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(
            device=device or "cpu",
            accelerator=accelerator,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._device_from_trainer = device is None
        self.transform = ModelTransform(
            activation_checkpointing,
            checkpoint_every_n,
            checkpoint_impl,
            quantization,
            lora,
            optimizer,
            adapter_only_checkpoint,
            pretrained=pretrained,
            pretrained_prefix=pretrained_prefix,
            qat=qat,
            fp8=fp8,
            activation_offloading=activation_offloading,
        )

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        """Lets the Trainer's accelerator connector hand over its device when none was given."""
        return None if self._device_from_trainer else [self.root_device]

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        if self._device_from_trainer and devices:
            self._root_device = devices[0]
            self._device_from_trainer = False

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="Single device with activation checkpointing and QLoRA", override=True
        )
