"""Activation offloading: tensors saved for backward wait in host memory instead of on the accelerator.

``OffloadActivations`` is a ``saved_tensors_hooks`` context (torchtune's ``OffloadActivations`` is the model):
during forward, each tensor autograd saves on the compute device, of at least ``min_bytes`` and not a parameter
or buffer, is copied to host memory and its device copy is released; backward copies it back when its node runs.
The values are copied bit for bit, so gradients are identical to a run without offloading. A tensor that several
ops save, or the same view of it (a layer input that the q, k and v projections each flatten), is copied once.

On CUDA the host copies are pinned and run on a side stream, so the device-to-host copy overlaps the next ops of
forward; ``record_stream`` keeps each device buffer alive until the copy that reads it, or the op that reads the
restored tensor, has run.

With activation checkpointing, a checkpointed block saves only its inputs (its own hooks keep everything inside
away from these hooks), so only block inputs, and what runs outside the blocks (embeddings, head, loss), move.

Not moved: tensor subclasses (float8 or quantized tensors), tensors smaller than ``min_bytes`` and parameters.
Each saved tensor is reported to the active saved-tensor counters (``pl_lowprec.memory.activations``), which count
a moved one as host bytes instead of device bytes; what they hand back is kept (by autograd, or by the host copy),
so that a tensor counts only while the graph that saved it lives.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.autograd.graph import saved_tensors_hooks

from pl_lowprec.memory.activations import note_saved, unpack_saved

MIN_OFFLOAD_BYTES = 1024  # smaller tensors cost more in copy overhead than they free (torchtune's threshold)


@dataclass
class _OnHost:
    tensor: torch.Tensor
    device: torch.device
    counted: object = None  # the saved-tensor counters' holder: the copy counts as host bytes while it lives


class OffloadActivations(saved_tensors_hooks):
    """Within the context, saved activations on ``device`` move to host memory until backward needs them.

    Args:
        device: The compute device whose saved tensors move.
        exclude: Tensors that never move (the model's parameters and buffers): autograd saves weights too.
        min_bytes: Smaller tensors stay where they are.
    """

    def __init__(
        self, device: torch.device, exclude: Iterable[torch.Tensor] = (), min_bytes: int = MIN_OFFLOAD_BYTES
    ) -> None:
        self.device = _indexed(torch.device(device))
        self.min_bytes = min_bytes
        self._excluded = {t.untyped_storage()._cdata for t in exclude if t.layout == torch.strided}
        self._cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if self._cuda else None
        self._copies: dict[tuple, tuple[weakref.ref, _OnHost]] = {}  # see _identity
        super().__init__(self._pack, self._unpack)

    def _moves(self, tensor: torch.Tensor) -> bool:
        return (
            (type(tensor) is torch.Tensor or isinstance(tensor, FakeTensor))
            and tensor.layout == torch.strided
            and tensor.device == self.device
            and tensor.numel() * tensor.element_size() >= self.min_bytes
            and tensor.untyped_storage()._cdata not in self._excluded
        )

    def _pack(self, tensor: torch.Tensor) -> object:
        if not self._moves(tensor):
            return note_saved(tensor, offloaded=False)  # the tensor, or the counters' holder of it
        owner, key = _identity(tensor)
        known = self._copies.get(key)
        if known is not None and known[0]() is owner:  # the same memory, still alive, saved again by another op
            return known[1]
        counted = note_saved(tensor, offloaded=True)
        packed = _OnHost(self._to_host(tensor), tensor.device, counted)
        self._copies[key] = (weakref.ref(owner), packed)
        return packed

    def _unpack(self, packed: object) -> torch.Tensor:
        self._copies.clear()  # backward has begun: each host copy now lives only as long as autograd needs it
        return self._to_device(packed) if isinstance(packed, _OnHost) else unpack_saved(packed)

    @torch.no_grad()
    def _to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        if not self._cuda:
            return tensor.detach().clone()  # CPU compute (tests, estimates): a separate copy, same path
        compute = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(compute)  # the tensor is fully written before the copy reads it
        with torch.cuda.stream(self._stream):
            host = torch.empty_like(tensor, device="cpu", pin_memory=True)
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(self._stream)  # its memory is reused only after the copy has read it
        return host

    @torch.no_grad()
    def _to_device(self, packed: _OnHost) -> torch.Tensor:
        if not self._cuda:
            return packed.tensor
        with torch.cuda.stream(self._stream):
            restored = packed.tensor.to(packed.device, non_blocking=True)
        compute = torch.cuda.current_stream(self.device)
        compute.wait_stream(self._stream)
        restored.record_stream(compute)  # allocated on the side stream, read on the compute stream
        return restored


def _indexed(device: torch.device) -> torch.device:
    """``cuda`` as the tensors on it report it (``cuda:0``): ``torch.device("cuda") != torch.device("cuda:0")``."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _identity(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """The live tensor that owns ``tensor``'s memory (its base, for a view) and a key for ``tensor``'s place in it.

    While the owner is alive its memory cannot be reused, so an equal key with the same owner means equal values.
    """
    owner = tensor._base if tensor._base is not None else tensor
    return owner, (id(owner), tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)


def check_offload_device(device: torch.device) -> None:
    """Refuse offloading where there is nothing to offload: a model that trains in host memory already."""
    if device.type == "cpu":
        raise ValueError(
            "activation_offloading=True moves saved activations from the accelerator to host memory, but this"
            " Trainer trains on cpu, where they already are: there is nothing to offload. Remove"
            " activation_offloading, or train on a CUDA device (Trainer(accelerator='cuda'))."
        )
    if device.type != "cuda":
        raise ValueError(
            f"activation_offloading=True supports CUDA devices (pinned host memory, a copy stream); this Trainer"
            f" trains on {device.type}. Remove activation_offloading, or train on a CUDA device."
        )
