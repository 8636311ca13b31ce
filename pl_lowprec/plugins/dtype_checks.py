"""Checks on the model's dtypes that must pass before the first mixed-precision step.

Each one turns a failure that would otherwise surface deep inside a training step (GradScaler's
"Attempting to unscale FP16 gradients", a CUDA kernel without bf16) into an error that names the problem
and the fix.
"""

from __future__ import annotations

import torch
from torch import nn

from pl_lowprec.transforms.dtypes import upcast_to_fp32

_NAMES_SHOWN = 8


def half_trainable_parameters(module: nn.Module) -> list[str]:
    """Names of trainable parameters stored in fp16, which GradScaler cannot unscale."""
    return [name for name, p in module.named_parameters() if p.requires_grad and p.dtype == torch.float16]


def upcast_parameters(module: nn.Module, names: list[str]) -> int:
    """Cast the named parameters to fp32 in place (same ``Parameter`` objects, a DTensor's rows too); return the
    bytes added."""
    wanted = set(names)
    added = 0
    for name, param in module.named_parameters():
        if name in wanted:
            added += param.numel() * 2
            upcast_to_fp32(param)
    return added


def format_names(names: list[str]) -> str:
    shown = ", ".join(names[:_NAMES_SHOWN])
    more = len(names) - _NAMES_SHOWN
    return shown + (f" (and {more} more)" if more > 0 else "")


def verify_bf16_support(device: torch.device) -> None:
    """Raise if ``device`` is a CUDA GPU without bf16, naming the GPU and the fp16 alternative."""
    if device.type != "cuda" or torch.cuda.is_bf16_supported():
        return
    name = torch.cuda.get_device_name(device)
    raise ValueError(
        f"AMPPrecision('bf16-mixed') was asked for, but the GPU {name!r} has no bf16 support"
        " (bf16 needs compute capability 8.0 or newer, e.g. A100, RTX 30xx, H100)."
        " Use AMPPrecision('16-mixed'), which scales the loss to keep fp16 gradients in range."
    )
