"""torchao NF4 base weights: the 4-bit storage that FSDP2 shards with its quantization constants.

bitsandbytes keeps a ``Params4bit``'s constants in a ``quant_state`` beside the packed bytes, and
``fully_shard`` turns the parameter into a plain tensor without it (bitsandbytes #1424). torchao's
``NF4Tensor`` holds the packed 4-bit data, the int8 block scales and their per-group factors as inner tensors
and implements FSDP2's ``fsdp_pre_all_gather``/``fsdp_post_all_gather``: each rank keeps its rows of all three,
and the all-gather rebuilds the full weight before the layer runs. The layer stays a plain ``nn.Linear`` whose
frozen weight is an ``NF4Tensor``; ``F.linear`` dequantizes it to the input's dtype (torchao's ``linear_nf4``),
and peft's plain LoRA ``Linear`` wraps it.

NF4Tensor always double-quantizes: each ``block_size`` run of weights has one scale, stored as int8 in groups of
``scaler_block_size`` scales with one factor per group. A weight shards across N ranks only when its rows, its
blocks and its scale groups each split evenly; ``check_layout`` says which layer does not, before anything runs.
``scaler_block_size="auto"`` (the default) picks for each weight the largest group size that splits (256, torchao's
default, where it fits): hidden 576 (SmolLM2) has 5,184 blocks in a 576 x 576 projection, 20.25 groups of 256.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from pl_lowprec._imports import import_torchao_nf4
from pl_lowprec.transforms.linear_filter import linear_names, swap_linear_layers
from pl_lowprec.transforms.quantization import QuantizationConfig, will_quantize

SHARDABLE_MODES = ("nf4", "nf4-dq")
SCALER_BLOCK_SIZES = (256, 128, 64, 32, 16, 8, 4, 2)  # what "auto" tries, largest first

ScalerBlockSize = int | Literal["auto"]


@dataclass(frozen=True)
class NF4Layout:
    """How NF4 weights are blocked: one scale per ``block_size`` weights, one int8 factor per
    ``scaler_block_size`` scales (torchao's defaults, as in torchtune's QLoRA); ``"auto"``: per weight, the
    largest of ``SCALER_BLOCK_SIZES`` that splits across the ranks (``for_weight``)."""

    block_size: int = 64
    scaler_block_size: ScalerBlockSize = "auto"

    def __post_init__(self) -> None:
        for name in ("block_size", "scaler_block_size"):
            value = getattr(self, name)
            if name == "scaler_block_size" and value == "auto":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 2 or value % 2:
                allowed = "an even integer >= 2" + (" or 'auto' (default)" if name == "scaler_block_size" else "")
                raise ValueError(f"nf4_{name}={value!r} is not valid: use {allowed} (default 64 / 'auto').")

    @property
    def is_auto(self) -> bool:
        return self.scaler_block_size == "auto"

    def for_weight(self, shape: tuple[int, ...], world_size: int) -> NF4Layout:
        """The layout a weight of ``shape`` is stored with: this one, or under ``"auto"`` the largest scaler block
        size that splits across ``world_size`` ranks (the largest that fills its groups when none does, so that
        ``problem`` names why)."""
        if not self.is_auto:
            return self
        sizes = [NF4Layout(self.block_size, size) for size in SCALER_BLOCK_SIZES]
        return next((layout for layout in sizes if layout.problem(shape, world_size) is None), sizes[-1])

    def problem(self, shape: tuple[int, ...], world_size: int) -> str | None:
        """Why a weight of ``shape`` cannot be stored as NF4 and split across ``world_size`` ranks, or ``None``."""
        rows, numel = shape[0], int(torch.Size(shape).numel())
        if numel % self.block_size:
            return f"{numel} weights do not fill blocks of nf4_block_size={self.block_size}"
        if self.is_auto:
            chosen = self.for_weight(shape, world_size)
            if chosen.problem(shape, world_size) is None:
                return None
            if rows % world_size:
                return f"its {rows} rows do not split evenly across {world_size} ranks"
            return (
                f"its {numel // self.block_size} blocks split into scale groups across {world_size} ranks with"
                f" no nf4_scaler_block_size in {list(SCALER_BLOCK_SIZES)}"
            )
        blocks = numel // self.block_size
        if blocks % self.scaler_block_size:
            return f"its {blocks} blocks do not fill groups of nf4_scaler_block_size={self.scaler_block_size}"
        groups = blocks // self.scaler_block_size
        if rows % world_size:
            return f"its {rows} rows do not split evenly across {world_size} ranks"
        if groups % world_size:
            return f"its {groups} scale group(s) do not split evenly across {world_size} ranks"
        return None

    def scaler_block_sizes_that_fit(self, shapes: list[tuple[int, ...]], world_size: int) -> list[int]:
        """Powers of two up to 256 that would make every shape fit (with this ``block_size``)."""
        fits = []
        for size in (256, 128, 64, 32, 16, 8, 4, 2):
            layout = NF4Layout(self.block_size, size)
            if all(layout.problem(s, world_size) is None for s in shapes):
                fits.append(size)
        return fits


def check_mode(config: QuantizationConfig) -> None:
    if config.mode not in SHARDABLE_MODES:
        raise ValueError(
            f"quantization={config.mode!r} cannot shard: strategy='lowprec_fsdp' stores 4-bit weights as torchao"
            f" NF4 tensors, which FSDP2 splits with their constants. Allowed: {', '.join(map(repr, SHARDABLE_MODES))}"
            " (both double-quantize the block scales). fp4 and int8 bitsandbytes weights lose their quantization"
            " state under fully_shard (bitsandbytes #1424): use strategy='lowprec_ddp' for them."
        )


def check_layout(model: nn.Module, config: QuantizationConfig, layout: NF4Layout, world_size: int) -> dict[str, int]:
    """Each layer to quantize and its scaler block size; ``ValueError`` naming every layer whose NF4 blocks cannot
    split across the ranks."""
    shapes = {
        name: tuple(module.weight.shape)
        for name, module in model.named_modules()
        if name and will_quantize(module, name, config)
    }
    bad = {name: why for name, shape in shapes.items() if (why := layout.problem(shape, world_size)) is not None}
    if not bad:
        return {name: layout.for_weight(shape, world_size).scaler_block_size for name, shape in shapes.items()}
    shown = "; ".join(f"{name} {list(shapes[name])}: {why}" for name, why in list(bad.items())[:4])
    fits = [] if layout.is_auto else layout.scaler_block_sizes_that_fit(list(shapes.values()), world_size)
    fix = (
        f"Pass nf4_scaler_block_size={fits[0]} (every layer fits with {fits}), or 'auto' to choose per layer"
        if fits
        else "Leave these layers unquantized with QuantizationConfig(skip_modules=[...]), or change the ranks"
    )
    raise ValueError(
        f"{len(bad)} of {len(shapes)} layers cannot be stored as NF4 and sharded across {world_size} ranks"
        f" (nf4_block_size={layout.block_size}, nf4_scaler_block_size={layout.scaler_block_size!r}): {shown}. {fix}."
    )


def describe_choice(scaler_sizes: dict[str, int], world_size: int) -> str:
    """One line: which scaler block size ``"auto"`` chose for which layers (named by their last two parts)."""
    by_size: dict[int, list[str]] = {}
    for name, size in scaler_sizes.items():
        short = ".".join(name.split(".")[-2:])
        if short not in by_size.setdefault(size, []):
            by_size[size].append(short)
    parts = []
    for size, names in sorted(by_size.items(), reverse=True):
        count = sum(1 for s in scaler_sizes.values() if s == size)
        shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        parts.append(f"{size} for {count} layer{'s' if count > 1 else ''} ({shown})")
    where = f"across {world_size} ranks" if world_size > 1 else "on 1 process"
    return f"NF4 nf4_scaler_block_size='auto' {where}: {'; '.join(parts)}."


def nf4_linear(linear: nn.Linear, layout: NF4Layout, device: torch.device, world_size: int = 1) -> nn.Linear:
    """The same ``nn.Linear`` with its weight frozen as an ``NF4Tensor`` (quantized on ``device``); an ``"auto"``
    layout resolves for this weight and ``world_size`` ranks."""
    nf4 = import_torchao_nf4()
    chosen = layout.for_weight(tuple(linear.weight.shape), world_size)
    weight = linear.weight.detach().to(device).contiguous()
    linear.weight = nn.Parameter(nf4.to_nf4(weight, chosen.block_size, chosen.scaler_block_size), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.detach().to(device), requires_grad=False)
    return linear


def quantize_model_nf4(
    model: nn.Module, config: QuantizationConfig, layout: NF4Layout, device: torch.device, world_size: int = 1
) -> list[str]:
    """Store the weights of the model's exact ``nn.Linear`` layers as NF4 (idempotent); return the names."""
    if any(is_nf4(p) for p in model.parameters()):
        return []

    def make_layer(linear: nn.Linear, name: str) -> nn.Module:
        return nf4_linear(linear, layout, device, world_size)

    replaced = swap_linear_layers(model, make_layer, lambda m, n: will_quantize(m, n, config))
    if not replaced:
        raise ValueError(
            f"quantization={config.mode!r} found no nn.Linear to quantize in {type(model).__name__}; its linear"
            f" layers are: {', '.join(linear_names(model)) or 'none'} (skip_modules={list(config.skip_modules)})."
        )
    return replaced


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard; any other tensor as it is."""
    return tensor.to_local() if hasattr(tensor, "to_local") and hasattr(tensor, "placements") else tensor


def is_nf4(tensor: torch.Tensor) -> bool:
    return type(local(tensor)).__name__ == "NF4Tensor"


def dequantize_nf4(tensor: torch.Tensor) -> torch.Tensor:
    """The float weight of an NF4 tensor, sharded (a DTensor of NF4 shards) or not, as one full tensor.

    Each rank dequantizes its own rows (its shard holds whole blocks and scale groups), then the float rows are
    gathered: the NF4 all-gather outside FSDP's own hooks is not needed."""
    if hasattr(tensor, "placements"):
        rows = local(tensor).get_original_weight()
        return DTensor.from_local(rows, tensor.device_mesh, tensor.placements).full_tensor()
    return tensor.get_original_weight()


def nf4_bytes(tensor: torch.Tensor) -> int:
    """Bytes this rank holds for an NF4 weight (its shard of the packed data, scales and factors, plus the
    per-tensor mean and the 16-entry code table); 0 for any other tensor."""
    held = local(tensor)
    if not is_nf4(held):
        return 0
    inner = (held.quantized_data, held.quantized_scalers, held.quantization_factor, held.scaler_mean, held.nf4)
    return sum(t.numel() * t.element_size() for t in inner)
