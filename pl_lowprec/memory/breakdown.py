"""Exact byte counts of where training memory goes: weights by dtype, gradients, optimizer state.

Each function walks the live objects and counts every storage once, so tied weights and views are not counted
twice. bitsandbytes weights are recognised by their attributes (no import needed) and counted together with
their quantization state: ``absmax``, the code book, and the nested constants of double quantization. Tensor
subclasses that wrap other tensors (torchao's quantized weights: int data, scales, zero points) are counted as
the tensors they hold, not as the logical size they present.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from pl_lowprec.transforms.nf4 import is_nf4, local


class StorageSet:
    """Counts each storage once: ``nbytes(t)`` is the size of ``t``'s storage the first time it is seen, else 0.

    Storages are told apart by their StorageImpl address, which fake tensors (no data pointer) have too.
    """

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._seen: set[int] = set()
        for tensor in exclude:
            self.nbytes(tensor)

    def nbytes(self, tensor: object) -> int:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta" or tensor.layout != torch.strided:
            return 0
        if is_traceable_wrapper_subclass(tensor):  # its own storage is a placeholder of the logical size
            names, _ = tensor.__tensor_flatten__()
            return sum(self.nbytes(getattr(tensor, name)) for name in names)
        storage = tensor.untyped_storage()
        if storage._cdata in self._seen:
            return 0
        self._seen.add(storage._cdata)
        return storage.nbytes()

    def forget(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage again if seen later: it is about to be freed, and its address reused."""
        self.forget_address(tensor.untyped_storage()._cdata)

    def forget_address(self, address: int) -> None:
        self._seen.discard(address)


def quantization_kind(param: torch.Tensor) -> str | None:
    """``"4bit"`` for bitsandbytes ``Params4bit`` and torchao's ``NF4Tensor``, ``"8bit"`` for ``Int8Params``, the
    target dtype (``"int4"``) for other torchao quantized weights, else ``None``. An FSDP2 parameter (a DTensor) is
    the kind of its local shard: a sharded bf16 or fp32 weight is not a quantized one."""
    param = local(param)
    if is_nf4(param):
        return "4bit"
    if is_traceable_wrapper_subclass(param):
        target = getattr(param, "target_dtype", None)
        return str(target).removeprefix("torch.") if target is not None else type(param).__name__
    if getattr(param, "quant_state", None) is not None:
        return "4bit"
    if type(param).__name__ == "Int8Params":
        return "8bit"
    return None


def quant_state_tensors(module: nn.Module, param: torch.Tensor) -> list[torch.Tensor]:
    """The tensors that dequantize ``param`` of ``module``: absmax and code books (nested ones with double
    quantization) for 4-bit; the row scales for int8, which bitsandbytes moves to ``module.state`` after the
    first forward."""
    state = getattr(param, "quant_state", None)
    if state is not None:
        tensors = [state.absmax, state.code, getattr(state, "offset", None)]
        nested = getattr(state, "state2", None)
        if nested is not None:
            tensors += [nested.absmax, nested.code]
    else:
        tensors = [getattr(param, "SCB", None), getattr(getattr(module, "state", None), "SCB", None)]
    return [t for t in tensors if isinstance(t, torch.Tensor)]


def parameter_bytes(model: nn.Module) -> dict[str, int]:
    """Parameter bytes keyed by dtype name, quantized weights as ``quantized_4bit``/``quantized_8bit``."""
    seen = StorageSet()
    out: dict[str, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            kind = quantization_kind(param)
            key = f"quantized_{kind}" if kind else str(param.dtype).removeprefix("torch.")
            size = seen.nbytes(param) + sum(seen.nbytes(t) for t in quant_state_tensors(module, param))
            if size:
                out[key] = out.get(key, 0) + size
    return out


def buffer_bytes(model: nn.Module) -> int:
    seen = StorageSet()
    return sum(seen.nbytes(b) for b in model.buffers())


def gradient_bytes(model: nn.Module) -> int:
    seen = StorageSet()
    return sum(seen.nbytes(p.grad) for p in model.parameters())


def optimizer_state_bytes(optimizers: Iterable[torch.optim.Optimizer]) -> int:
    """Bytes of every tensor in the optimizers' per-parameter state (Adam moments, 8-bit quantiles, ...)."""
    seen = StorageSet()
    total = 0
    for optimizer in optimizers:
        for state in optimizer.state.values():
            total += sum(seen.nbytes(v) for v in state.values())
    return total
