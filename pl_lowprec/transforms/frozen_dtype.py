"""Frozen weights in the compute dtype under mixed precision.

Autocast reads every frozen weight in the compute dtype anyway (a linear layer casts its weight for each matmul),
so holding a frozen embedding or head in fp32 only costs memory: on Llama-3.1-8B shapes the untied embedding and
head are 3.9 GiB in fp32 against 2.0 GiB in bf16. A bf16 checkpoint built into a fp32 module would otherwise stay
upcast for the whole run. Trainable parameters and norm weights stay in fp32 (``prepare_for_kbit_training``), and
so do the scalars and vectors that scale activations elementwise (``read_elementwise``) and what a transformers
model declares it keeps in fp32 (``declared_fp32_parameters``);
quantized weights are not floating point and are left alone; under ``32-true`` nothing changes.

Outside autocast (an evaluation loop, a notebook, a comparison after training) a half-precision frozen layer
would meet the fp32 outputs of the norms; like bitsandbytes' 4-bit layers, it then casts its input to its
weight's dtype and its output back to the input's. Under autocast the hooks do nothing.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from pl_lowprec.transforms.dtypes import HALF_DTYPES
from pl_lowprec.transforms.lora import is_norm

_WEIGHT_DTYPE = "_pl_lowprec_frozen_dtype"
_OUTPUT_DTYPE = "_pl_lowprec_output_dtype"


def cast_frozen_weights(model: nn.Module, compute_dtype: torch.dtype) -> int:
    """Cast frozen, unquantized, non-norm floating-point parameters to ``compute_dtype`` (fp16 or bf16), a rank's
    rows too (a DTensor, as FSDP2's streamed load leaves them: they stayed fp32 before); return the bytes saved (of
    this rank's rows). A weight that fp16 cannot hold (a finite value that overflows) is refused, not cast. Every
    module left with frozen weights in ``compute_dtype`` casts its inputs outside autocast (``cast_inputs``)."""
    if compute_dtype not in HALF_DTYPES:
        return 0
    declared_fp32 = declared_fp32_parameters(model, compute_dtype)
    saved = 0
    for name, module in model.named_modules():
        if is_norm(module):
            continue
        frozen_half = False
        for param_name, param in module.named_parameters(recurse=False):
            data = param.data
            local = data.to_local() if isinstance(data, DTensor) else data  # a rank's rows, streamed in under FSDP2
            if param.requires_grad or type(local) is not torch.Tensor or not local.is_floating_point():
                continue  # trainable, a tensor subclass (torchao NF4), or quantized integers
            if read_elementwise(module, local):
                continue  # a temperature, a layer scale: autocast would not cast it, so bf16 would round it
            if declared_fp32 is not None and declared_fp32.search(f"{name}.{param_name}" if name else param_name):
                continue  # the model reads it in fp32 (an MoE router), as its from_pretrained keeps it
            if local.element_size() > torch.finfo(compute_dtype).bits // 8:
                cast = data.to(compute_dtype)  # a DTensor stays one, with its placements
                cast_local = cast.to_local() if isinstance(cast, DTensor) else cast
                if compute_dtype == torch.float16 and not local.is_meta:
                    mesh = data.device_mesh if isinstance(data, DTensor) else None
                    _check_fp16_range(f"{name}.{param_name}" if name else param_name, local, cast_local, mesh)
                saved += local.numel() * (local.element_size() - cast_local.element_size())
                if isinstance(cast, DTensor):  # ``.data =`` would leave its local rows fp32: swap, ties kept
                    del data, local
                    torch.utils.swap_tensors(param, nn.Parameter(cast, requires_grad=False))
                    data = param
                else:
                    param.data = data = cast
            frozen_half = frozen_half or data.dtype == compute_dtype
        if frozen_half:
            cast_inputs(module, compute_dtype)
    return saved


def declared_fp32_parameters(model: nn.Module, compute_dtype: torch.dtype) -> re.Pattern[str] | None:
    """The parameters a transformers model inside declares must stay fp32 in ``compute_dtype``, matched as its
    ``from_pretrained`` matches them (a regular-expression search, ``*`` any text): ``_keep_in_fp32_modules_strict``
    under bf16 and fp16, ``_keep_in_fp32_modules`` under fp16 too. An MoE router's weight (Ernie-4.5-MoE's
    ``gate.weight``) is read in fp32 with autocast off: rounded to bf16, it would route tokens otherwise."""
    patterns: set[str] = set()
    for module in model.modules():
        patterns.update(getattr(module, "_keep_in_fp32_modules_strict", None) or ())
        if compute_dtype == torch.float16:
            patterns.update(getattr(module, "_keep_in_fp32_modules", None) or ())
    return re.compile("|".join(p.replace("*", ".*") for p in sorted(patterns))) if patterns else None


def read_elementwise(module: nn.Module, param: torch.Tensor) -> bool:
    """A scalar or vector of a module other than a linear layer or an embedding (a logit temperature, a LayerScale
    gamma, attention sinks): no matmul reads it in the compute dtype, it scales activations in fp32, and it is too
    small to matter to memory. A linear layer's bias is cast as autocast casts it."""
    return param.ndim <= 1 and not isinstance(module, (nn.Linear, nn.Embedding))


def cast_inputs(module: nn.Module, weight_dtype: torch.dtype) -> None:
    """Outside autocast, ``module`` computes in ``weight_dtype`` and returns its input's dtype (idempotent)."""
    if hasattr(module, _WEIGHT_DTYPE):
        return
    setattr(module, _WEIGHT_DTYPE, weight_dtype)
    module.register_forward_pre_hook(_cast_floating_inputs)
    module.register_forward_hook(_restore_output_dtype)


def _first_floating(args: tuple[Any, ...]) -> torch.Tensor | None:
    return next((a for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()), None)


def _cast_floating_inputs(module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    weight_dtype = getattr(module, _WEIGHT_DTYPE)
    first = _first_floating(args)
    if first is None or first.dtype == weight_dtype or torch.is_autocast_enabled(first.device.type):
        return None
    setattr(module, _OUTPUT_DTYPE, first.dtype)
    return tuple(a.to(weight_dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args)


def _restore_output_dtype(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
    first = _first_floating(args)
    if first is not None and torch.is_autocast_enabled(first.device.type):
        # The pre-hook cast nothing, so there is nothing to pop: training (always under autocast) never touches the
        # module's __dict__, which torch.compile before 2.13 cannot trace (a graph break in every compiled block).
        return None
    dtype = module.__dict__.pop(_OUTPUT_DTYPE, None)
    if dtype is None or not isinstance(output, torch.Tensor) or not output.is_floating_point():
        return None
    return output.to(dtype)


def _check_fp16_range(name: str, before: torch.Tensor, after: torch.Tensor, mesh: Any = None) -> None:
    """Refuse a weight with values fp16 cannot hold; with a rank's rows (``mesh``: their device mesh), on every
    rank together, so none is left waiting in the next collective. The reduction runs on the mesh's device: rows
    kept in CPU memory (``cpu_offload=True``) still reduce over NCCL, which takes no CPU tensors."""
    largest = before.abs().max() if before.numel() else before.new_zeros(())  # a rank may hold no rows
    overflow = torch.stack([(torch.isfinite(before) & ~torch.isfinite(after)).any().float(), largest.float()])
    if mesh is not None:
        overflow = overflow.to(mesh.device_type)
        torch.distributed.all_reduce(overflow, op=torch.distributed.ReduceOp.MAX, group=mesh.get_group())
    if bool(overflow[0]):
        largest = float(overflow[1])
        raise ValueError(
            f"The frozen weight {name} holds values up to {largest:.3g}, beyond float16's range (65504): under"
            " 16-mixed pl_lowprec keeps frozen weights in the compute dtype, and this one would become inf. Train"
            " under bf16-mixed (same memory, bfloat16's range), or 32-true."
        )
