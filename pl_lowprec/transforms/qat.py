"""Quantization-aware training (torchao): train with fake-quantized linear layers, then convert to the real thing.

``prepare_qat`` swaps the model's exact ``nn.Linear`` layers for torchao's ``FakeQuantizedLinear`` (through
``torchao.quantize_`` with a ``QATConfig(base, step="prepare")``): the weights stay full-precision parameters
that train, and every forward rounds them (and, for the dynamic-activation scheme, the inputs) exactly as the
quantized kernel will. ``convert_qat`` merges any LoRA adapters into their base weights and applies the same
base config for real (``step="convert"``): the weights become torchao quantized tensors
(``IntxUnpackedToInt8Tensor``: int values, one scale per group) whose outputs equal the fake-quantized ones.

The fake quantizers of these schemes are dynamic (scales computed from the current weights), so they hold no
state: the state dict during QAT is the plain model's, and a checkpoint resumes exactly.

With LoRA (as torchtune's QAT-LoRA): the frozen base weight and the input are fake-quantized, the adapter runs in
full precision beside them, and conversion quantizes base + adapter together.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

import torch
from torch import nn

from pl_lowprec._imports import import_torchao
from pl_lowprec.transforms.linear_filter import DEFAULT_SKIP, is_target_linear

QATScheme = Literal["int8-dynamic-int4-weight", "int4-weight-only", "int8-weight-only"]
QAT_SCHEMES: tuple[str, ...] = get_args(QATScheme)


@dataclass(frozen=True)
class QATConfig:
    """Which quantization to simulate during training, and where.

    Args:
        scheme: ``"int8-dynamic-int4-weight"`` (int8 per-token activations, quantized on the fly, and int4
            grouped weights: torchao's 8da4w, the usual target for CPU and mobile inference),
            ``"int4-weight-only"`` or ``"int8-weight-only"``.
        group_size: Weights that share one scale (along the input dimension); ``None`` gives one scale per
            output channel. Smaller groups are more accurate and store more scales. Each quantized layer's
            ``in_features`` must be a multiple of it.
        skip_modules: Glob patterns of module names left in full precision (default: output heads).
        convert_on_fit_end: Convert to the real quantized form when ``fit`` ends. ``False`` keeps the
            fake-quantized model (to train further); call ``convert_qat`` or ``save_quantized`` later.
    """

    scheme: QATScheme
    group_size: int | None = 32
    skip_modules: Sequence[str] = field(default=DEFAULT_SKIP)
    convert_on_fit_end: bool = True

    def __post_init__(self) -> None:
        if self.scheme not in QAT_SCHEMES:
            raise ValueError(
                f"qat scheme {self.scheme!r} is not supported. Allowed: {', '.join(map(repr, QAT_SCHEMES))}."
            )
        size = self.group_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(
                f"qat group_size={size!r} is not valid: use a positive integer such as 32 (one scale per 32 weights)"
                " or None (one scale per output channel)."
            )
        object.__setattr__(self, "skip_modules", tuple(self.skip_modules))

    @classmethod
    def from_scheme(cls, scheme: str, **overrides: Any) -> QATConfig:
        return cls(scheme=scheme, **overrides)  # type: ignore[arg-type]

    def base_config(self) -> Any:
        """The torchao post-training config that QAT simulates and that conversion applies."""
        import_torchao()
        from torchao.quantization import (
            Int8DynamicActivationIntxWeightConfig,
            IntxWeightOnlyConfig,
            PerAxis,
            PerGroup,
        )

        granularity = PerAxis(0) if self.group_size is None else PerGroup(self.group_size)
        if self.scheme == "int8-dynamic-int4-weight":
            return Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=granularity)
        bits = torch.int4 if self.scheme == "int4-weight-only" else torch.int8
        return IntxWeightOnlyConfig(weight_dtype=bits, granularity=granularity)

    def wants(self, module: nn.Module, name: str) -> bool:
        """Exact ``nn.Linear`` layers outside ``skip_modules`` (subclasses such as MHA's ``out_proj`` stay)."""
        return is_target_linear(module, name, self.skip_modules)


def is_fake_quantized(module: nn.Module) -> bool:
    return type(module).__name__ == "FakeQuantizedLinear"


def is_converted(model: nn.Module) -> bool:
    """Whether the model holds torchao quantized weights (QAT converted, or quantized after training)."""
    import_torchao()
    from torchao.utils import TorchAOBaseTensor

    return any(isinstance(p, TorchAOBaseTensor) for p in model.parameters())


def prepare_qat(model: nn.Module, config: QATConfig) -> list[str]:
    """Fake-quantize the chosen linear layers (idempotent); return the names of the layers swapped.

    Raises ``ValueError`` when no layer is chosen, or when a layer's ``in_features`` is not a multiple of the
    group size (torchao's grouped quantization cannot split it).
    """
    import_torchao()
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig as TorchaoQATConfig

    if any(is_fake_quantized(m) for m in model.modules()):
        return []
    chosen = [(name, m) for name, m in model.named_modules() if name and config.wants(m, name)]
    if not chosen:
        raise ValueError(
            f"qat={config.scheme!r} found no nn.Linear to fake-quantize in {type(model).__name__}"
            f" outside skip_modules={list(config.skip_modules)}. QAT applies to nn.Linear weights only."
        )
    if config.group_size is not None:
        uneven = [f"{n} ({m.in_features})" for n, m in chosen if m.in_features % config.group_size]
        if uneven:
            raise ValueError(
                f"qat group_size={config.group_size} does not divide in_features of {', '.join(uneven[:6])}:"
                " torchao's grouped quantization needs whole groups. Choose a group size that divides them,"
                " group_size=None (per channel), or add those layers to skip_modules."
            )
    names = {name for name, _ in chosen}
    quantize_(model, TorchaoQATConfig(config.base_config(), step="prepare"), filter_fn=lambda m, n: n in names)
    return sorted(names)


@torch.no_grad()
def convert_qat(model: nn.Module, config: QATConfig) -> list[str]:
    """Merge LoRA adapters into their base layers, then quantize the fake-quantized layers for real.

    Returns the names of the converted layers; the model is then for inference (its quantized weights do not
    train).
    """
    import_torchao()
    from torchao.quantization import quantize_
    from torchao.quantization.qat import QATConfig as TorchaoQATConfig

    merge_lora(model)
    names = [name for name, m in model.named_modules() if is_fake_quantized(m)]
    if not names:
        raise ValueError(
            f"convert_qat: {type(model).__name__} has no fake-quantized layer (was it prepared with qat=, or"
            " converted already?)."
        )
    quantize_(model, TorchaoQATConfig(config.base_config(), step="convert"), filter_fn=None)
    return names


def merge_lora(model: nn.Module) -> list[str]:
    """Fold every peft LoRA layer into its base layer and put the base layer back in its place."""
    lora_types = _lora_layer_types()
    layers = [(n, m) for n, m in model.named_modules() if lora_types and isinstance(m, lora_types)]
    for name, layer in layers:
        layer.merge(safe_merge=True)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer.get_base_layer())
    if layers:
        model.__dict__.pop("peft_config", None)
    return [n for n, _ in layers]


def _lora_layer_types() -> tuple[type, ...]:
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return ()
    return (LoraLayer,)


def save_quantized(model: nn.Module, path: str | Path, config: QATConfig | None = None) -> Path:
    """Write the quantized model's state dict (torchao tensors; ``torch.load(path, weights_only=True)`` reads it).

    A model still fake-quantized is converted first, which needs ``config``.
    """
    if not is_converted(model):
        if config is None:
            raise ValueError("save_quantized: the model is not converted yet; pass the QATConfig it trained with.")
        convert_qat(model, config)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), path)
    return path
