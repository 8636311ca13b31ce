"""A SwiGLU MLP whose three projections carry LoRA runs as one autograd Function that keeps only x, gate and up.

Why: with every block checkpointed, a QLoRA step peaks in the top block's MLP backward. There autograd holds,
each of tokens x intermediate size: the gate and up outputs, ``silu(gate)``, the down projection's input, the
down weight dequantized whole, and its input gradient twice (the base's and LoRA's, summed afterwards). On
Llama-3.1-8B at batch 2 x 2048 that is 6 x 112 MiB. Unsloth's fused LoRA MLP keeps the gate and up outputs only
and recomputes the rest; this does the same and also never dequantizes the down weight whole:

- forward computes the down projection in blocks of the weight's rows (blocks of output features: exact);
- backward walks the intermediate features in blocks: the down weight's columns are dequantized block by
  block, the SwiGLU gradient is formed there and written over the saved gate and up outputs, so it never
  exists beside them.

The peak of the MLP is 3 x tokens x intermediate instead of 6. The ops are the ones peft, bitsandbytes and
autograd run (the same matmuls, ``silu``, ``silu_backward``, in the compute dtype, the input gradient summed in
autograd's order), so the loss and the gradients are the same, up to the order in which a CPU's or GPU's
matmul kernels sum (``tests/transforms/test_fused_lora_mlp.py``).

Used under autocast while gradients are recorded, when each projection is a LoRA layer with one active adapter,
no dropout, no DoRA and no bias, over a bitsandbytes 4-bit or a plain linear base; otherwise the module's own
forward runs.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from pl_lowprec.transforms.lora import ADAPTER_NAME, lora_layers

_HOOKED = "_pl_lowprec_fused_lora_mlp"
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
CHUNK_ELEMENTS = 1 << 23  # a block's temporaries: 16 MiB each in bf16, whatever the model's size


def fuse_lora_mlps(model: nn.Module) -> int:
    """Route every fusable SwiGLU MLP of ``model`` through the fused Function (idempotent); return how many now."""
    lora = set(lora_layers(model).values())
    fused = 0
    for module in model.modules():
        if getattr(module, _HOOKED, False) or not _is_swiglu_mlp(module):
            continue
        if all(getattr(module, name) in lora for name in PROJECTIONS):
            module.forward = _FusedForward(module)
            setattr(module, _HOOKED, True)
            fused += 1
    return fused


def _is_swiglu_mlp(module: nn.Module) -> bool:
    act = getattr(module, "act_fn", None)
    silu = isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"
    plain = not hasattr(module, "dropout")  # the forward is down(act(gate(x)) * up(x)), nothing more
    return silu and plain and type(module).__name__.endswith("MLP") and all(hasattr(module, n) for n in PROJECTIONS)


class _FusedForward:
    """The MLP's ``forward``: the fused Function when the layers allow it at this call, else the original."""

    def __init__(self, module: nn.Module) -> None:
        self.module, self.forward = module, module.forward

    def __call__(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        layers = None
        if isinstance(x, torch.Tensor) and not args and not kwargs and torch.is_grad_enabled():
            device = x.device.type
            if torch.is_autocast_enabled(device) and x.dtype == torch.get_autocast_dtype(device):
                layers = _fusable_layers(self.module)
        if layers is None:
            return self.forward(x, *args, **kwargs)
        adapters = [w for layer in layers for w in (_adapter(layer, "lora_A"), _adapter(layer, "lora_B"))]
        scalings = tuple(layer.scaling[ADAPTER_NAME] for layer in layers)
        bases = tuple(layer.get_base_layer() for layer in layers)
        return _LoraSwiGLU.apply(x, bases, scalings, *adapters)


def _adapter(layer: nn.Module, name: str) -> torch.Tensor:
    return getattr(layer, name)[ADAPTER_NAME].weight


def _fusable_layers(mlp: nn.Module) -> tuple[nn.Module, ...] | None:
    layers = tuple(getattr(mlp, name) for name in PROJECTIONS)
    return layers if all(_plain_lora(layer) for layer in layers) else None


def _plain_lora(layer: nn.Module) -> bool:
    """One active adapter, unmerged, without dropout, DoRA or bias, over a frozen 4-bit or plain base."""
    if getattr(layer, "merged", True) or getattr(layer, "disable_adapters", True):
        return False
    if list(layer.active_adapters) != [ADAPTER_NAME] or ADAPTER_NAME not in layer.lora_A:
        return False
    if ADAPTER_NAME in getattr(layer, "lora_variant", {}) or getattr(layer, "lora_bias", {}).get(ADAPTER_NAME):
        return False
    if not isinstance(layer.lora_dropout[ADAPTER_NAME], nn.Identity):
        return False
    base = layer.get_base_layer()
    if getattr(base, "bias", None) is not None or base.weight.requires_grad:
        return False
    state = _quant_state(base)
    if state is None:  # a plain weight, not a wrapper subclass with its own matmul (torchao's NF4, DTensor)
        return type(base) is nn.Linear and not is_traceable_wrapper_subclass(base.weight)
    return base.weight.dtype == torch.uint8 and state.quant_type in ("nf4", "fp4") and state.shape[1] % 2 == 0


def _quant_state(base: nn.Module) -> Any:
    """bitsandbytes' ``QuantState``: on the weight for ``Linear4bit``, on the module for the estimator's stand-in."""
    state = getattr(base.weight, "quant_state", None)
    return getattr(base, "quant_state", None) if state is None else state


class _Weight:
    """A frozen base weight read block by block in the compute dtype (4-bit blocks dequantized on demand)."""

    def __init__(self, base: nn.Module, dtype: torch.dtype) -> None:
        self.dtype, self.state, self.weight = dtype, _quant_state(base), base.weight
        if self.state is None:
            self.rows, self.cols = self.weight.shape
            return
        self.rows, self.cols = self.state.shape
        absmax = self.state.absmax
        if self.state.nested:  # per-block scales: 8-bit codes of fp32 scales (bitsandbytes' double quantization)
            nested = self.state.state2
            absmax = torch.ops.bitsandbytes.dequantize_blockwise.default(
                absmax, nested.absmax, nested.code, nested.blocksize, torch.float32
            )
            absmax = absmax + self.state.offset
        # rows made of whole 4-bit blocks can be dequantized a few at a time; otherwise the weight is one block
        self.aligned = self.cols % self.state.blocksize == 0
        self.absmax = absmax.reshape(self.rows, -1) if self.aligned else absmax
        self.packed = self.weight.reshape(self.rows, self.cols // 2) if self.aligned else self.weight

    def block(self, rows: slice = slice(None), cols: slice = slice(None)) -> torch.Tensor:
        if self.state is None:
            return self.weight[rows, cols].to(self.dtype)
        size = self.state.blocksize
        if not self.aligned:
            whole = torch.ops.bitsandbytes.dequantize_4bit.default(
                self.packed.reshape(-1, 1), self.absmax, size, self.state.quant_type, self.state.shape, self.state.dtype
            )
            return whole.to(self.dtype)[rows, cols]
        packed = self.packed[rows, _scaled(cols, 2)].contiguous()
        absmax = self.absmax[rows, _scaled(cols, size)].contiguous()
        shape = (packed.shape[0], packed.shape[1] * 2)
        out = torch.ops.bitsandbytes.dequantize_4bit.default(
            packed.reshape(-1, 1), absmax.reshape(-1), size, self.state.quant_type, shape, self.state.dtype
        )
        return out.to(self.dtype)

    def row_blocks(self) -> list[slice]:
        if self.state is not None and not self.aligned:
            return [slice(None)]
        step = max(1, CHUNK_ELEMENTS // self.cols)
        return [slice(i, min(i + step, self.rows)) for i in range(0, self.rows, step)]

    def column_blocks(self, tokens: int) -> list[slice]:
        """Blocks of whole 4-bit blocks of columns, each ``tokens x width`` about ``CHUNK_ELEMENTS``."""
        if self.state is not None and not self.aligned:
            return [slice(None)]
        align = self.state.blocksize if self.state is not None else 1
        step = max(align, CHUNK_ELEMENTS // max(tokens, 1) // align * align)
        return [slice(i, min(i + step, self.cols)) for i in range(0, self.cols, step)]


def _scaled(cols: slice, factor: int) -> slice:
    start = None if cols.start is None else cols.start // factor
    stop = None if cols.stop is None else cols.stop // factor
    return slice(start, stop)


class _LoraSwiGLU(torch.autograd.Function):
    """``down(silu(gate(x)) * up(x))`` with LoRA on each projection; saves x, gate, up and the rank-r inputs."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, bases: tuple, scalings: tuple, *adapters: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        a_g, b_g, a_u, b_u, a_d, b_d = (w.to(dtype) for w in adapters)
        s_g, s_u, s_d = scalings
        x2 = x.reshape(-1, x.shape[-1])
        gate, low_g = _lora_linear(x2, _Weight(bases[0], dtype), a_g, b_g, s_g)
        up, low_u = _lora_linear(x2, _Weight(bases[1], dtype), a_u, b_u, s_u)
        hidden = F.silu(gate).mul_(up)
        low_d = hidden @ a_d.t()
        down = _Weight(bases[2], dtype)
        out = torch.empty(x2.shape[0], down.rows, dtype=dtype, device=x.device)
        for rows in down.row_blocks():  # blocks of output features: the full dot product each, so exact
            out[:, rows] = hidden @ down.block(rows=rows).t()
        del hidden
        out.add_((low_d @ b_d.t()).mul_(s_d))
        ctx.save_for_backward(x2, gate, up, low_g, low_u, low_d, *adapters)
        ctx.bases, ctx.scalings, ctx.input_shape = bases, scalings, x.shape
        return out.reshape(*x.shape[:-1], down.rows)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x2, gate, up, low_g, low_u, low_d, *adapters = ctx.saved_tensors
        dtype = gate.dtype
        a_g, b_g, a_u, b_u, a_d, b_d = (w.to(dtype) for w in adapters)
        s_g, s_u, s_d = ctx.scalings
        dy = grad.reshape(-1, grad.shape[-1]).to(dtype)
        dy_scaled = dy * s_d
        grad_b_d = dy_scaled.t() @ low_d
        grad_low_d = dy_scaled @ b_d
        del dy_scaled
        grad_a_d = torch.empty_like(a_d)
        down = _Weight(ctx.bases[2], dtype)
        for cols in down.column_blocks(dy.shape[0]):
            grad_hidden = dy @ down.block(cols=cols)
            grad_hidden += grad_low_d @ a_d[:, cols]
            gate_c, up_c = gate[:, cols], up[:, cols]
            act = F.silu(gate_c)
            grad_a_d[:, cols] = grad_low_d.t() @ (act * up_c)
            grad_up_c = grad_hidden * act
            del act
            grad_gate_c = torch.ops.aten.silu_backward(grad_hidden * up_c, gate_c)
            del grad_hidden
            gate_c.copy_(grad_gate_c)  # gate and up now hold their gradients: nothing else reads them
            up_c.copy_(grad_up_c)
            del grad_gate_c, grad_up_c
        grad_gate, grad_up = gate, up
        grad_b_g, grad_low_g = _lora_grads(grad_gate, low_g, b_g, s_g)
        grad_b_u, grad_low_u = _lora_grads(grad_up, low_u, b_u, s_u)
        grad_x = None
        if ctx.needs_input_grad[0]:
            # summed in the order autograd sums them for the unfused MLP (its last-made branch first)
            grad_x = grad_low_u @ a_u
            grad_x += grad_up @ _Weight(ctx.bases[1], dtype).block()
            grad_x += grad_low_g @ a_g
            grad_x += grad_gate @ _Weight(ctx.bases[0], dtype).block()
            grad_x = grad_x.reshape(ctx.input_shape)
        grad_a_g = grad_low_g.t() @ x2
        grad_a_u = grad_low_u.t() @ x2
        grads = (grad_a_g, grad_b_g, grad_a_u, grad_b_u, grad_a_d, grad_b_d)
        return grad_x, None, None, *(g.to(w.dtype) for g, w in zip(grads, adapters, strict=True))


def _lora_linear(
    x: torch.Tensor, weight: _Weight, a: torch.Tensor, b: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``x W^T + scaling * (x A^T) B^T`` as peft computes it (base, then LoRA's output added); and ``x A^T``."""
    out = x @ weight.block().t()  # the dequantized weight is freed here
    low = x @ a.t()
    out.add_((low @ b.t()).mul_(scaling))
    return out, low


def _lora_grads(grad_out: torch.Tensor, low: torch.Tensor, b: torch.Tensor, scaling: float) -> tuple:
    """Gradients of B and of ``x A^T`` from the output's gradient, as autograd forms them for peft's
    ``lora_B(low) * scaling`` (the scaled gradient first: one temporary of the output's size)."""
    scaled = grad_out * scaling
    return scaled.t() @ low, scaled @ b
