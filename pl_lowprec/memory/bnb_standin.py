"""The one stand-in for bitsandbytes layers in a fake step: it holds and allocates what the real layer does.

``Params4bit`` and ``Int8Params`` are tensor subclasses that cannot wrap a FakeTensor, so the fake model holds
these layers instead. They subclass bitsandbytes' own classes, so that peft makes its bitsandbytes LoRA layers
(and their defensive ``result.clone()``, which allocates) and the package recognises them as quantized.

4-bit: the packed uint8 weight and the QuantState tensors (absmax, nested absmax, code books) are buffers;
``forward`` is ``Linear4bit.forward`` (cast to the compute dtype, ``bnb.matmul_4bit``, cast back) and bitsandbytes'
own ``MatMul4Bit`` runs. Its ``gemm_4bit`` has no CPU or CUDA kernel for training: the registered composite runs
(dequantize the absmax, dequantize the weight to ``B_dq`` [N, K] in the input dtype, ``linear``), and the tracker
runs that composite too (``DECOMPOSE``), so ``B_dq`` lives as long as it does for real. Backward dequantizes to
the dtype the weight was quantized from (``weight_dtype``, ``quantization.dequantized_dtype``).
Checked layer by layer against the profiler (``docs/design/peak-memory-research.md``, Q4): byte for byte.

int8 (``Linear8bitLt``, frozen weights): the int8 weight and one fp32 scale per row; the matmul quantizes its
input to int8, accumulates in int32 and returns the compute dtype; backward dequantizes the weight. This
follows bitsandbytes' ``MatMul8bitLt`` allocations in size, not checked against the profiler.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pl_lowprec._imports import import_bitsandbytes
from pl_lowprec.memory.tracker import DECOMPOSE
from pl_lowprec.transforms.nf4 import local
from pl_lowprec.transforms.quantization import QuantizationConfig, dequantized_dtype


def fake_quantized_layer(
    linear: nn.Linear, config: QuantizationConfig, compute_dtype: torch.dtype, device: torch.device
) -> nn.Module:
    """The stand-in for ``quantization.quantize_linear`` (same signature), on the meta device."""
    classes = _classes()
    if config.is_4bit:
        quant_type, _, dq = config.mode.partition("-")
        return classes["4bit"](
            linear, quant_type, bool(dq), config.compute_dtype or compute_dtype, config.quant_storage
        )
    return classes["8bit"](linear)


_CLASSES: dict[str, type] = {}
_CODE_BOOKS: dict[str, torch.Tensor] = {}


def _shared_code_book(name: str, size: int) -> torch.Tensor:
    """One code book per kind for every layer, as ``quantization.share_code_books`` leaves the real model."""
    if name not in _CODE_BOOKS:
        _CODE_BOOKS[name] = torch.empty(size, dtype=torch.float32, device="meta")
    return _CODE_BOOKS[name]


def _classes() -> dict[str, type]:
    """Defined on first use: they subclass bitsandbytes' layers, imported only when quantizing."""
    if _CLASSES:
        return _CLASSES
    bnb = import_bitsandbytes()
    from bitsandbytes.functional import QuantState

    decompose_gemm_4bit()

    class FakeLinear4bit(bnb.nn.Linear4bit):
        """bitsandbytes ``Linear4bit`` as fake buffers (its ``__init__`` is skipped: it would build Params4bit)."""

        def __init__(
            self,
            linear: nn.Linear,
            quant_type: str,
            compress_statistics: bool,
            compute_dtype: torch.dtype,
            quant_storage: torch.dtype,
        ) -> None:
            nn.Module.__init__(self)
            self.in_features, self.out_features = linear.in_features, linear.out_features
            self.compute_dtype, self.weight_dtype = compute_dtype, dequantized_dtype(linear.weight.dtype, compute_dtype)
            self.quant_type, self.compress_statistics, self.blocksize = quant_type, compress_statistics, 64
            self.quant_storage = quant_storage
            numel = linear.in_features * linear.out_features
            blocks = math.ceil(numel / self.blocksize)
            packed = torch.empty(((numel + 1) // 2 // quant_storage.itemsize, 1), dtype=quant_storage, device="meta")
            self.weight = nn.Parameter(packed, requires_grad=False)
            self.weight.compress_statistics, self.weight.quant_type = compress_statistics, quant_type  # peft reads
            self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
            meta = {"device": "meta"}
            if compress_statistics:
                self.register_buffer("absmax", torch.empty(blocks, dtype=torch.uint8, **meta))
                self.register_buffer("absmax2", torch.empty(math.ceil(blocks / 256), dtype=torch.float32, **meta))
                self.register_buffer("code2", _shared_code_book("nested", 256))
                self.register_buffer("offset", torch.empty((), dtype=torch.float32, **meta))
            else:
                self.register_buffer("absmax", torch.empty(blocks, dtype=torch.float32, **meta))
            self.register_buffer("code", _shared_code_book(quant_type, 16))

        @property
        def quant_state(self) -> Any:
            """Rebuilt from the buffers, so it follows meta -> fake materialization."""
            nested = None
            if self.compress_statistics:
                nested = QuantState(absmax=self.absmax2, code=self.code2, blocksize=256, dtype=torch.float32)
            return QuantState(
                absmax=self.absmax,
                shape=torch.Size([self.out_features, self.in_features]),
                code=self.code,
                blocksize=self.blocksize,
                quant_type=self.quant_type,
                dtype=self.weight_dtype,
                offset=self.offset if nested is not None else None,
                state2=nested,
            )

        @property
        def W_q(self) -> torch.Tensor:
            """peft's mark of a layer that dequantizes itself (``dequantize_module_weight``): DoRA's weight norm
            reads the whole weight, which peft finds on ``Params4bit`` alone, and this weight is a plain tensor."""
            return self.weight

        def dequantize(self) -> torch.Tensor:
            """The [out, in] weight in ``weight_dtype``, as ``bnb.functional.dequantize_4bit`` gives it."""
            return bnb.functional.dequantize_4bit(self.weight, self.quant_state)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # Linear4bit.forward in training
            inp_dtype = x.dtype
            bias = None if self.bias is None else self.bias.to(self.compute_dtype)
            out = bnb.matmul_4bit(x.to(self.compute_dtype), self.weight, bias=bias, quant_state=self.quant_state)
            return out.to(inp_dtype)

        def _apply(self, fn: Any, recurse: bool = True) -> Any:
            """A dtype cast (``HalfPrecision.convert_module``) leaves the quantized storage and its constants."""
            probe = fn(torch.empty(1, device="meta"))
            if probe.dtype != torch.float32 and self.weight.device.type == probe.device.type:
                if self.bias is not None:
                    self.bias.data = fn(self.bias.data)
                return self
            return super()._apply(fn, recurse)

    class _MatMul8bit(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
            rows = x.reshape(-1, x.shape[-1])
            quantized = torch.empty(rows.shape, dtype=torch.int8, device=x.device)  # the input in int8
            row_scale = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
            accumulated = torch.empty(rows.shape[0], weight.shape[0], dtype=torch.int32, device=x.device)
            out = accumulated.to(x.dtype)
            del quantized, row_scale, accumulated
            ctx.save_for_backward(weight, scale)
            ctx.input_dtype = x.dtype
            return out.reshape(*x.shape[:-1], weight.shape[0])

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
            weight, scale = ctx.saved_tensors
            dequantized = weight.to(grad.dtype) * scale.to(grad.dtype)[:, None]
            return grad @ dequantized, None, None

    class FakeLinear8bitLt(bnb.nn.Linear8bitLt):
        """bitsandbytes ``Linear8bitLt`` with frozen int8 weights as buffers."""

        def __init__(self, linear: nn.Linear) -> None:
            nn.Module.__init__(self)
            self.in_features, self.out_features = linear.in_features, linear.out_features
            self.state, self.index = bnb.MatmulLtState(), None
            self.state.has_fp16_weights = False
            shape = (linear.out_features, linear.in_features)
            self.weight = nn.Parameter(torch.empty(shape, dtype=torch.int8, device="meta"), requires_grad=False)
            self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)
            self.register_buffer("SCB", torch.empty(linear.out_features, dtype=torch.float32, device="meta"))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = _MatMul8bit.apply(x, self.weight, self.SCB)
            return out if self.bias is None else out + self.bias.to(out.dtype)

        def _apply(self, fn: Any, recurse: bool = True) -> Any:
            probe = fn(torch.empty(1, device="meta"))
            if probe.dtype != torch.float32 and self.weight.device.type == probe.device.type:
                return self
            return nn.Module._apply(self, fn, recurse)

    _CLASSES.update({"4bit": FakeLinear4bit, "8bit": FakeLinear8bitLt})
    return _CLASSES


def decompose_gemm_4bit() -> None:
    """Under the package's dispatch modes, bitsandbytes' 4-bit matmul runs as its registered composite
    (dequantize, then ``linear``), whose parts they see: the tracker its ``B_dq``, the op counter its bytes
    and FLOPs (bitsandbytes' CUDA kernel does the same for training shapes)."""
    from bitsandbytes.backends.default.ops import _gemm_4bit_default_impl

    DECOMPOSE[torch.ops.bitsandbytes.gemm_4bit.default] = _gemm_4bit_default_impl


def is_standin(module: nn.Module) -> bool:
    return bool(_CLASSES) and isinstance(module, tuple(_CLASSES.values()))


def quantized_bytes(module: nn.Module) -> int:
    """The bytes a stand-in holds: the quantized weight and its constants (code books included)."""
    return sum(t.numel() * t.element_size() for t in [*module.parameters(recurse=False), *module.buffers(False)])


class FakeOptimizer8bit(torch.optim.Optimizer):
    """bitsandbytes' 8-bit optimizers in a fake step (their ``step`` reassigns ``p.data``, which fake parameters
    refuse): the state they hold (uint8 state and one fp32 absmax per 256 elements for tensors of 4096+ elements,
    with the shared 256-entry fp32 maps; fp32 state below that), and a step that updates in place, as the fused
    CUDA kernel does. bitsandbytes' CPU implementation makes fp32 temporaries this does not see.

    ``torchao=True``: torchao's ``AdamW8bit`` instead (its real ``step`` crashes on fake tensors): the same blocks
    only where the element count is also a multiple of 256, each state with its own 256-entry fp32 map, and state
    in the parameter's dtype elsewhere, and a fp32 step; under FSDP2, for this rank's shard."""

    def __init__(
        self, params: Any, states: int, min_8bit_size: int = 4096, block: int = 256, torchao: bool = False
    ) -> None:
        super().__init__(params, {"lr": 0.0})
        self.states, self.min_8bit_size, self.block, self.torchao = states, min_8bit_size, block, torchao
        self._shared_maps: dict[int, torch.Tensor] = {}  # bitsandbytes' dynamic maps, one per state, shared

    def _shared_map(self, index: int) -> torch.Tensor:
        if index not in self._shared_maps:
            self._shared_maps[index] = torch.empty(256, dtype=torch.float32)
        return self._shared_maps[index]

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    held = local(param)
                    n = held.numel()
                    quantized = n >= self.min_8bit_size and (not self.torchao or n % self.block == 0)
                    for index in range(1, self.states + 1):
                        if quantized:
                            state[f"state{index}"] = torch.empty(n, dtype=torch.uint8)
                            state[f"absmax{index}"] = torch.empty(math.ceil(n / self.block), dtype=torch.float32)
                            own = torch.empty(256, dtype=torch.float32) if self.torchao else self._shared_map(index)
                            state[f"qmap{index}"] = own
                        else:
                            state[f"state{index}"] = torch.empty(n, dtype=held.dtype if self.torchao else torch.float32)
                    state["step"] = torch.zeros((), dtype=torch.float32) if self.torchao else 0  # torchao: fp32
                state["step"] += 1
