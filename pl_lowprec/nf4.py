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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pl_lowprec._imports import import_torchao_nf4
from pl_lowprec.quantization import QuantizationConfig, linear_names, swap_linear_layers, will_quantize

SHARDABLE_MODES = ("nf4", "nf4-dq")


@dataclass(frozen=True)
class NF4Layout:
    """How NF4 weights are blocked: one scale per ``block_size`` weights, one int8 factor per
    ``scaler_block_size`` scales (torchao's defaults, as in torchtune's QLoRA)."""

    block_size: int = 64
    scaler_block_size: int = 256

    def __post_init__(self) -> None:
        for name in ("block_size", "scaler_block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 2 or value % 2:
                raise ValueError(f"nf4_{name}={value!r} is not valid: use an even integer >= 2 (default 64 / 256).")

    def problem(self, shape: tuple[int, ...], world_size: int) -> str | None:
        """Why a weight of ``shape`` cannot be stored as NF4 and split across ``world_size`` ranks, or ``None``."""
        rows, numel = shape[0], int(torch.Size(shape).numel())
        if numel % self.block_size:
            return f"{numel} weights do not fill blocks of nf4_block_size={self.block_size}"
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


def check_layout(model: nn.Module, config: QuantizationConfig, layout: NF4Layout, world_size: int) -> None:
    """Raise ``ValueError`` naming every layer to quantize whose NF4 blocks cannot split across the ranks."""
    shapes = {
        name: tuple(module.weight.shape)
        for name, module in model.named_modules()
        if name and will_quantize(module, name, config)
    }
    bad = {name: why for name, shape in shapes.items() if (why := layout.problem(shape, world_size)) is not None}
    if not bad:
        return
    shown = "; ".join(f"{name} {list(shapes[name])}: {why}" for name, why in list(bad.items())[:4])
    fits = layout.scaler_block_sizes_that_fit(list(shapes.values()), world_size)
    fix = (
        f"Pass nf4_scaler_block_size={fits[0]} (every layer fits with {fits})"
        if fits
        else "Leave these layers unquantized with QuantizationConfig(skip_modules=[...]), or change the ranks"
    )
    raise ValueError(
        f"{len(bad)} of {len(shapes)} layers cannot be stored as NF4 and sharded across {world_size} ranks"
        f" (nf4_block_size={layout.block_size}, nf4_scaler_block_size={layout.scaler_block_size}): {shown}. {fix}."
    )


def nf4_linear(linear: nn.Linear, layout: NF4Layout, device: torch.device) -> nn.Linear:
    """The same ``nn.Linear`` with its weight frozen as an ``NF4Tensor`` (quantized on ``device``)."""
    nf4 = import_torchao_nf4()
    weight = linear.weight.detach().to(device).contiguous()
    linear.weight = nn.Parameter(nf4.to_nf4(weight, layout.block_size, layout.scaler_block_size), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.detach().to(device), requires_grad=False)
    return linear


def quantize_model_nf4(
    model: nn.Module, config: QuantizationConfig, layout: NF4Layout, device: torch.device
) -> list[str]:
    """Store the weights of the model's exact ``nn.Linear`` layers as NF4 (idempotent); return the names."""
    if any(is_nf4(p) for p in model.parameters()):
        return []

    def make_layer(linear: nn.Linear, name: str) -> nn.Module:
        return nf4_linear(linear, layout, device)

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
        from torch.distributed.tensor import DTensor

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
