"""A bias that trains on a bitsandbytes layer keeps its dtype.

bitsandbytes' 4-bit and 8-bit layers cast their bias to the compute dtype in place on every forward
(``bias.data = bias.data.to(x.dtype)``). For a frozen bias that costs nothing; a bias that trains (peft's
``bias='lora_only'`` or ``'all'``) was upcast to fp32 for mixed precision and came out of the first forward in
bf16: no fp32 copy, its optimizer state in bf16, updates under half a bf16 step lost, and nothing said. Such a
layer here runs bitsandbytes' matmul without the bias and adds it after, cast for the add only (its gradient
comes back in the bias's own dtype), as ``nn.Linear`` under autocast and torchao's NF4 linear do.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from pl_lowprec.transforms.quantization import is_quantized

_HOOKED = "_pl_lowprec_own_bias"


def keep_trainable_biases(model: nn.Module) -> list[str]:
    """Every bitsandbytes layer of ``model`` whose bias trains adds its bias itself (idempotent); the names."""
    hooked = []
    for name, module in model.named_modules():
        bias = getattr(module, "bias", None)
        if is_quantized(module) and bias is not None and bias.requires_grad and not getattr(module, _HOOKED, False):
            module.forward = types.MethodType(_forward_adding_bias, module)
            setattr(module, _HOOKED, True)
            hooked.append(name)
    return hooked


def _forward_adding_bias(self: nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    bias = self._parameters["bias"]
    self._parameters["bias"] = None  # out of bitsandbytes' reach for its matmul
    try:
        out = type(self).forward(self, x, *args, **kwargs)
    finally:
        self._parameters["bias"] = bias
    return out + bias.to(out.dtype)
