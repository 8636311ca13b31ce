"""Frozen weights in the compute dtype under mixed precision.

Autocast reads every frozen weight in the compute dtype anyway (a linear layer casts its weight for each matmul),
so holding a frozen embedding or head in fp32 only costs memory: on Llama-3.1-8B shapes the untied embedding and
head are 3.9 GiB in fp32 against 2.0 GiB in bf16. A bf16 checkpoint built into a fp32 module would otherwise stay
upcast for the whole run. Trainable parameters and norm weights stay in fp32 (``prepare_for_kbit_training``);
quantized weights are not floating point and are left alone; under ``32-true`` nothing changes.
"""

from __future__ import annotations

import torch
from torch import nn

from pl_lowprec.transforms.lora import is_norm

HALF_DTYPES = (torch.float16, torch.bfloat16)


def cast_frozen_weights(model: nn.Module, compute_dtype: torch.dtype) -> int:
    """Cast frozen, unquantized, non-norm floating-point parameters to ``compute_dtype`` (fp16 or bf16); return
    the bytes saved. A weight that fp16 cannot hold (a finite value that overflows) is refused, not cast."""
    if compute_dtype not in HALF_DTYPES:
        return 0
    saved = 0
    for name, module in model.named_modules():
        if is_norm(module):
            continue
        for param_name, param in module.named_parameters(recurse=False):
            data = param.data
            if param.requires_grad or type(data) is not torch.Tensor or not data.is_floating_point():
                continue  # trainable, a tensor subclass (torchao NF4, DTensor), or quantized integers
            if data.dtype == compute_dtype or data.element_size() <= torch.finfo(compute_dtype).bits // 8:
                continue
            cast = data.to(compute_dtype)
            if compute_dtype == torch.float16 and not data.is_meta:
                _check_fp16_range(f"{name}.{param_name}" if name else param_name, data, cast)
            saved += data.numel() * (data.element_size() - cast.element_size())
            param.data = cast
    return saved


def _check_fp16_range(name: str, before: torch.Tensor, after: torch.Tensor) -> None:
    if bool((torch.isfinite(before) & ~torch.isfinite(after)).any()):
        largest = float(before.abs().max())
        raise ValueError(
            f"The frozen weight {name} holds values up to {largest:.3g}, beyond float16's range (65504): under"
            " 16-mixed pl_lowprec keeps frozen weights in the compute dtype, and this one would become inf. Train"
            " under bf16-mixed (same memory, bfloat16's range), or 32-true."
        )
