"""The one place where a model is transformed, shared by ``LowPrecisionStrategy`` and its DDP twin.

What it does, in order: fill a module built on the meta device from ``pretrained=`` safetensors (quantizing
each layer as its weight streams in, ``pl_lowprec.loading``), quantize the base ``nn.Linear`` layers
(bitsandbytes), or fake-quantize them for quantization-aware training, or swap them for float8 training
(torchao), inject LoRA adapters (peft) and prepare them for the precision, then checkpoint activations. During
each training step it may offload saved activations to host memory; at the end of fit it converts a QAT model
to its real quantized form. After ``configure_optimizers`` it may swap the optimizer for a bitsandbytes one.
With LoRA, checkpoints hold only the trainable weights.

Where it runs, in ``Trainer._run`` order:

1. ``strategy.connect(model)``, ``setup`` hooks, ``LightningModule.configure_model``;
2. restoring weights from ``ckpt_path`` (``strategy.load_model_state_dict``): **the model transform runs here
   first** when resuming, so an adapter checkpoint loads into a freshly quantized, adapted model;
3. ``strategy.setup``: **the model transform runs here** otherwise, before the precision plugin's
   ``convert_module``, the move to the device, the DDP wrapper and ``configure_optimizers``; **the optimizer
   swap** runs right after ``configure_optimizers``, before the precision plugin connects to the optimizers;
4. restoring optimizer, scheduler and precision state, then the loops.

Under ``strategy="lowprec_fsdp"`` the transform holds a ``Sharding`` (``pl_lowprec.distributed.sharding``), and that is
the one place where a step differs: 4-bit weights are stored as torchao NF4 (which shards) instead of
bitsandbytes, a meta-device module keeps only each rank's rows of every tensor as it is loaded (or, without
``pretrained=``, initialized by its modules' ``reset_parameters``), and the last step shards each unit and the
root with FSDP2.

``apply`` is idempotent, derived from the model itself (quantized layers, LoRA layers and checkpointed blocks
are recognisable), so a second ``fit``, or ``validate`` after ``fit``, changes nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.optim import Optimizer

from pl_lowprec._imports import import_bitsandbytes, import_peft, import_torchao
from pl_lowprec.adapters import load_trainable_state_dict, trainable_state_dict
from pl_lowprec.distributed.sharding import Sharding
from pl_lowprec.loading import PretrainedWeights, empty_weights, has_meta_tensors, load_pretrained
from pl_lowprec.transforms.checkpointing import (
    CheckpointImpl,
    CheckpointPolicy,
    is_checkpointed,
    set_activation_checkpointing,
    validate_checkpoint_args,
)
from pl_lowprec.transforms.fp8 import FP8Config, FP8Recipe, check_fp8_device, convert_to_fp8
from pl_lowprec.transforms.lora import has_lora, inject_lora, lora_config, prepare_for_kbit_training
from pl_lowprec.transforms.offloading import OffloadActivations, check_offload_device
from pl_lowprec.transforms.optimizers import (
    OptimizerName,
    import_optimizer_library,
    rebind_schedulers,
    swap_optimizer,
    validate_optimizer_name,
)
from pl_lowprec.transforms.qat import QATConfig, QATScheme, convert_qat, is_converted, prepare_qat
from pl_lowprec.transforms.quantization import (
    DEFAULT_SKIP,
    QuantizationConfig,
    QuantMode,
    quantize_linear,
    quantize_model,
)

_DTYPE_BY_PRECISION = {
    "16-mixed": torch.float16,
    "bf16-mixed": torch.bfloat16,
    "16-true": torch.float16,
    "bf16-true": torch.bfloat16,
    "32-true": torch.float32,
    "64-true": torch.float64,
}


_LOADED_FROM = "_pl_lowprec_loaded_from"


@contextmanager
def _stacked(outer: AbstractContextManager, inner: AbstractContextManager) -> Iterator[None]:
    with outer, inner:
        yield


def teardown_with_meta(strategy: Any, teardown: Callable[[], None]) -> None:
    """Run the strategy's ``teardown`` even when a failed load left the module on the meta device.

    Lightning's teardown moves the module to the CPU, which meta tensors cannot do; that second error would
    hide the first (the one that names the bad checkpoint keys)."""
    module = strategy.lightning_module
    if module is None or not has_meta_tensors(module):
        teardown()
        return
    strategy._lightning_module = None
    try:
        teardown()
    finally:
        strategy._lightning_module = module


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
    pretrained: str | Path | None = None
    pretrained_prefix: str | Mapping[str, str] | None = None
    qat: QATScheme | QATConfig | None = None
    fp8: FP8Recipe | FP8Config | None = None
    activation_offloading: bool = False
    sharding: Sharding | None = None

    def __post_init__(self) -> None:
        validate_checkpoint_args(self.checkpoint_every_n, self.checkpoint_impl)
        if self.pretrained_prefix is not None and self.pretrained is None:
            raise ValueError(f"pretrained_prefix={self.pretrained_prefix!r} was given without pretrained=.")
        self.weights = PretrainedWeights(self.pretrained, self.pretrained_prefix) if self.pretrained else None
        if isinstance(self.quantization, str):
            self.quantization = QuantizationConfig.from_mode(self.quantization)
        if self.quantization is not None and self.sharding is not None:
            self.sharding.check_quantization(self.quantization)
        elif self.quantization is not None:
            import_bitsandbytes()
        if self.optimizer is not None:
            validate_optimizer_name(self.optimizer)
            import_optimizer_library(self.optimizer)
        if self.lora is not None:
            import_peft()
            self.lora = lora_config(self.lora)
        if self.qat is not None or self.fp8 is not None:
            import_torchao()
        if isinstance(self.qat, str):
            self.qat = QATConfig.from_scheme(self.qat)
        if isinstance(self.fp8, str):
            self.fp8 = FP8Config.from_recipe(self.fp8)
        _check_linear_transforms(self.quantization, self.qat, self.fp8)
        if not isinstance(self.activation_offloading, bool):
            raise TypeError(f"activation_offloading takes True or False, got {self.activation_offloading!r}.")

    @property
    def skip_modules(self) -> tuple[str, ...]:
        return tuple(self.quantization.skip_modules) if self.quantization is not None else DEFAULT_SKIP

    def apply(self, model: nn.Module, precision_plugin: Any, device: torch.device) -> None:
        if hasattr(precision_plugin, "resolve"):  # AMPPrecision("auto") chooses for the device before quantizing
            precision_plugin.resolve(device)
        if self.fp8 is not None:
            check_fp8_device(device, self.fp8)
        if self.activation_offloading:
            check_offload_device(device)
        if self.qat is not None and is_converted(model):
            _refuse_fitting_converted(model)
            return  # converted to its quantized form at the end of fit: the model is final
        compute_dtype = compute_dtype_of(precision_plugin)
        if self.sharding is not None:
            self.sharding.check(model, self.quantization)
        self.load_pretrained(model, compute_dtype, device)
        if self.quantization is not None:
            replaced = self.quantize(model, compute_dtype, device)
            if replaced:
                rank_zero_info(f"Quantized {len(replaced)} linear layers to {self.quantization.mode}.")
        if self.qat is not None:
            faked = prepare_qat(model, self.qat)
            if faked:
                rank_zero_info(f"QAT ({self.qat.scheme}): fake-quantized {len(faked)} linear layers.")
        if self.fp8 is not None:
            swapped = convert_to_fp8(model, self.fp8)
            if swapped:
                rank_zero_info(f"FP8 training ({self.fp8.recipe}) on {len(swapped)} linear layers.")
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
        if self.sharding is not None:
            units = self.sharding.shard(model)
            if units:
                rank_zero_info(f"FSDP2: {len(units)} shard units and the root across {self.sharding.world_size} ranks.")
            elif self.sharding.world_size == 1:
                rank_zero_info("FSDP2 on one process: the model is not sharded (NF4 weights as they are).")

    def quantize(self, model: nn.Module, compute_dtype: torch.dtype, device: torch.device) -> list[str]:
        """Base weights to 4/8 bit: bitsandbytes layers, or torchao NF4 weights when sharding (they shard)."""
        if self.sharding is not None:
            return self.sharding.quantize_model(model, self.quantization, device)
        return quantize_model(model, self.quantization, compute_dtype, device)

    def quantize_layer(
        self, linear: nn.Linear, config: QuantizationConfig, compute_dtype: torch.dtype, device: torch.device
    ) -> nn.Module:
        """One layer as ``pretrained=`` streams it in; the same choice of storage as ``quantize``."""
        if self.sharding is not None:
            return self.sharding.quantize_layer(linear, config, compute_dtype, device)
        return quantize_linear(linear, config, compute_dtype, device)

    def load_pretrained(self, model: nn.Module, compute_dtype: torch.dtype, device: torch.device) -> None:
        """Fill a module built on the meta device from ``pretrained=`` (or the module's ``pretrained_weights``),
        quantizing as it loads; once loaded, the module is marked and later calls change nothing."""
        weights = self.weights_for(model)
        if not has_meta_tensors(model):
            if weights is not None and getattr(model, _LOADED_FROM, None) is None:
                raise ValueError(
                    f"pretrained={str(weights.path)!r} needs {type(model).__name__} built without weights, but its"
                    " parameters are real. Build them on the meta device: inside `configure_model` under"
                    " `pl_lowprec.loading.empty_weights()`, or under `trainer.init_module(empty_init=True)`."
                )
            return
        if weights is None and self.sharding is not None:
            self.sharding.initialize(model, self.quantization, compute_dtype, device, self.quantize_layer)
            return
        if weights is None:
            raise ValueError(
                f"{type(model).__name__} has parameters on the meta device and nothing to fill them from: pass"
                " pretrained= (a safetensors file or model directory) to the strategy, or build it with weights."
            )
        place = self.sharding.placement() if self.sharding is not None else None
        load_pretrained(
            model, weights.path, weights.prefix, self.quantization, compute_dtype, device, self.quantize_layer, place
        )
        setattr(model, _LOADED_FROM, str(weights.path))

    def weights_for(self, model: nn.Module) -> PretrainedWeights | None:
        """The strategy's ``pretrained=``, else what the module names as its ``pretrained_weights``."""
        own = getattr(model, "pretrained_weights", None)
        if own is not None and not isinstance(own, PretrainedWeights):
            raise TypeError(f"{type(model).__name__}.pretrained_weights must be a PretrainedWeights, got {own!r}.")
        if self.weights is not None and own is not None and self.weights != own:
            raise ValueError(
                f"Two sources of pretrained weights: the strategy's pretrained={str(self.weights.path)!r} and"
                f" {type(model).__name__}.pretrained_weights={str(own.path)!r}. Name one."
            )
        return self.weights or own

    def tensor_init_context(self, default: AbstractContextManager) -> AbstractContextManager:
        """Under ``trainer.init_module(empty_init=True)`` with ``pretrained=``, parameters go on the meta device."""
        if self.weights is None:
            return default
        return _stacked(default, empty_weights())

    def offloading(self, model: nn.Module, device: torch.device) -> AbstractContextManager:
        """The context a training step runs in: saved activations to host memory, or nothing."""
        if not self.activation_offloading:
            return nullcontext()
        return OffloadActivations(device, exclude=[*model.parameters(), *model.buffers()])

    def on_fit_end(self, model: nn.Module) -> None:
        """Convert a QAT model to its real quantized form (``QATConfig.convert_on_fit_end``)."""
        if self.qat is not None and self.qat.convert_on_fit_end and not is_converted(model):
            converted = convert_qat(model, self.qat)
            rank_zero_info(f"QAT: converted {len(converted)} linear layers to {self.qat.scheme}.")

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
        if self.qat is not None and is_converted(model):
            return model.state_dict()  # adapters merged into the quantized weights: nothing trains any more
        return trainable_state_dict(model) if self.adapter_only else model.state_dict()

    def load_state_dict(self, model: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool) -> None:
        if self.adapter_only:
            load_trainable_state_dict(model, state_dict, strict=strict)
        else:
            model.load_state_dict(state_dict, strict=strict)


def _check_linear_transforms(quantization: Any, qat: QATConfig | None, fp8: FP8Config | None) -> None:
    """quantization=, qat= and fp8= each replace the linear layers; torchao cannot stack them."""
    given = [name for name, value in (("quantization", quantization), ("qat", qat), ("fp8", fp8)) if value is not None]
    if len(given) < 2:
        return
    why = {
        frozenset({"quantization", "qat"}): "QAT fake-quantizes full-precision weights that train, while"
        " quantization= freezes them in bitsandbytes 4/8-bit, which torchao's fake quantizers cannot read."
        " For a quantized base with adapters use quantization= + lora=; for QAT on adapters use qat= + lora=.",
        frozenset({"quantization", "fp8"}): "float8 training casts high-precision weights to float8 in every"
        " matmul; bitsandbytes 4/8-bit weights are neither, and torchao's Float8Linear cannot wrap them.",
        frozenset({"qat", "fp8"}): "both replace the same nn.Linear layers (FakeQuantizedLinear vs Float8Linear)"
        " and torchao has no layer that does both. Train with fp8=, then quantize after training; or use qat=.",
    }
    pair = frozenset(given[:2])
    raise ValueError(f"{'= and '.join(given)}= cannot be combined: {why[pair]}")


def _refuse_fitting_converted(model: nn.Module) -> None:
    trainer = getattr(model, "_trainer", None)
    if trainer is not None and trainer.state.fn == "fit":
        raise RuntimeError(
            "qat=: this model was converted to its quantized form at the end of an earlier fit, and quantized"
            " weights do not train. Fit a fresh model (or resume from a checkpoint written during QAT), or set"
            " QATConfig(convert_on_fit_end=False) to keep training the fake-quantized model."
        )
