"""Activations stay in the compute dtype under autocast: no fp32 copies of what every matmul reads in bf16.

Mixed precision keeps norm weights and LoRA adapters in fp32. Three things then keep fp32 copies of activations
that buy no precision, since every linear layer that reads them rounds them to the compute dtype again
(autocast, bitsandbytes, peft's LoRA path):

- a norm multiplies its fp32 weight with a bf16 input and returns fp32; bitsandbytes' layers return their input's
  dtype, so the MLP's activations and, after the first block, the residual stream turn fp32, which doubles each
  checkpointed block's input;
- a norm computes in fp32 (Hugging Face's ``RMSNorm`` upcasts its input) and keeps that fp32 copy for backward,
  beside the bf16 input the residual stream holds anyway;
- peft casts each LoRA layer's input to the adapter's dtype (fp32), and autocast casts it back to bf16 for the
  matmul and keeps that copy for backward: one more copy of the input per adapted layer.

Under autocast, norms here return their input's dtype (as Hugging Face's norms do when the weight is in the
compute dtype: transformers' bf16 loading, torchtune's recipes) and, while gradients are recorded, keep only
their bf16 input and redo their few elementwise ops in backward (the same ops under the same autocast, so the
same gradients; not under ``compile=``, which fuses them). LoRA layers read their input as it is (peft's
``_cast_input_dtype``, replaced on each layer): their matmuls are unchanged, since the round trip bf16 -> fp32 ->
bf16 is exact. Only the residual stream changes numbers: bf16 instead of fp32 from the second block on. On
Llama-3.1-8B QLoRA shapes, batch 2 x 2048, every block checkpointed, the three save about 1.7 GiB of the
predicted peak (``docs/memory.md``). Outside autocast nothing changes.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pl_lowprec.transforms.dtypes import HALF_DTYPES
from pl_lowprec.transforms.lora import is_norm, lora_layers

_HOOKED = "_pl_lowprec_autocast_activations"


def keep_activations_in_compute_dtype(model: nn.Module, recompute_norms: bool = True) -> int:
    """Hook every norm and LoRA layer of ``model`` (idempotent); return how many were hooked now.
    ``recompute_norms=False`` (under ``compile=``) only casts the norms' outputs."""
    hooked = 0
    for module in [m for m in model.modules() if is_norm(m)]:
        if not getattr(module, _HOOKED, False):
            module._pl_lowprec_norm_forward = module.forward
            module._pl_lowprec_recompute_norm = recompute_norms
            # a method bound to each norm, one function for all: torch.compile guards on the function, so the
            # blocks share one compiled graph (a callable object per norm was guarded by identity: one
            # recompile per block, and past torch._dynamo's recompile limit the rest ran eagerly)
            module.forward = types.MethodType(_lean_norm_forward, module)
            setattr(module, _HOOKED, True)
            hooked += 1
    for module in lora_layers(model).values():
        if not getattr(module, _HOOKED, False):
            module._cast_input_dtype = _cast_input_unless_autocast  # peft's method, read from the instance first
            setattr(module, _HOOKED, True)
            hooked += 1
    return hooked


def _lean_norm_forward(module: nn.Module, x: Any, *args: Any, **kwargs: Any) -> Any:
    """A norm's ``forward`` that, under autocast with a half-precision input, returns the input's dtype and, while
    gradients are recorded (and its own weights are frozen), keeps only its input for backward."""
    half = isinstance(x, torch.Tensor) and x.dtype in HALF_DTYPES
    if not half or not torch.is_autocast_enabled(x.device.type):
        return module._pl_lowprec_norm_forward(x, *args, **kwargs)
    in_input_dtype = functools.partial(_in_input_dtype, module._pl_lowprec_norm_forward)
    frozen = not any(p.requires_grad for p in module.parameters(recurse=False))
    recompute = module._pl_lowprec_recompute_norm and frozen and not args and not kwargs
    if recompute and torch.is_grad_enabled() and x.requires_grad:
        rowwise = not isinstance(module, nn.GroupNorm)  # LayerNorm and RMSNorm: over the last dim only
        return _RecomputedInBackward.apply(in_input_dtype, rowwise, x)
    return in_input_dtype(x, *args, **kwargs)


def _in_input_dtype(forward: Callable[..., Any], x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    out = forward(x, *args, **kwargs)
    return out.to(x.dtype) if isinstance(out, torch.Tensor) and out.is_floating_point() else out


def _kept(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class _RecomputedInBackward(torch.autograd.Function):
    """``fn(x)`` keeping only ``x``: backward runs ``fn`` again under the same autocast and differentiates it (the
    same ops, so the same gradients). ``rowwise``: ``fn`` treats each row of the last dim on its own (LayerNorm,
    RMSNorm), so backward goes a few rows at a time and its fp32 temporaries stay small."""

    @staticmethod
    def forward(ctx: Any, fn: Callable[..., torch.Tensor], rowwise: bool, x: torch.Tensor) -> torch.Tensor:
        ctx.fn, ctx.rowwise, ctx.autocast_dtype = fn, rowwise, torch.get_autocast_dtype(x.device.type)
        ctx.save_for_backward(x)
        return fn(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        if not ctx.rowwise or x.dim() < 2:
            return None, None, _recomputed_grad(ctx, x, grad)
        rows, grad_rows = x.reshape(-1, x.shape[-1]), grad.reshape(-1, x.shape[-1])
        grad_x = torch.empty_like(rows)
        step = max(1, ROW_ELEMENTS // max(x.shape[-1], 1))
        for start in range(0, rows.shape[0], step):
            part = slice(start, start + step)
            grad_x[part] = _recomputed_grad(ctx, rows[part], grad_rows[part])
        return None, None, grad_x.reshape(x.shape)


ROW_ELEMENTS = 1 << 22  # rows recomputed at once in a norm's backward: 16 MiB per fp32 temporary


def _recomputed_grad(ctx: Any, x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    autocast = torch.autocast(x.device.type, dtype=ctx.autocast_dtype)
    # what this short graph saves lives only until the next line: no activation counter or offloading sees it
    with torch.enable_grad(), autocast, torch.autograd.graph.saved_tensors_hooks(_kept, _kept):
        leaf = x.detach().requires_grad_()
        out = ctx.fn(leaf)
    return torch.autograd.grad(out, leaf, grad)[0]


def _cast_input_unless_autocast(x: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """peft's ``LoraLayer._cast_input_dtype`` for a hooked layer: under autocast the input stays as it is (autocast
    casts it for the matmul); outside, it is cast to the adapter's dtype as peft does. A pure function of its
    arguments, with no module state changed in forward: a flag set per call (``cast_input_dtype_enabled``) inside
    a checkpointed block is a side effect ``torch.compile`` cannot trace, and broke every compiled block's graph."""
    if x is None or x.dtype == dtype or torch.is_autocast_enabled(x.device.type):
        return x
    return x.to(dtype)
