"""Count the bytes that autograd keeps for backward: the activation memory of a training step.

``torch.autograd.graph.saved_tensors_hooks`` sees every tensor an op saves for its backward. Storages are
counted once, and storages shared with the model's parameters are left out (they are weights, not
activations). Activation checkpointing replaces a block's saved tensors with its inputs; the checkpointed
forward reports those inputs here (``note_checkpoint_inputs``), so the count stays the real one. Selective
checkpointing keeps some op outputs in its own cache, outside autograd's saved tensors; its policy reports them
here (``note_kept_outputs``).

Activation offloading (``pl_lowprec.transforms.offloading``) installs its own hooks inside the counter's, and only the
innermost hooks run; it reports each saved tensor here (``note_saved``) with where it went and keeps what that
returns: the counter's holder instead of a tensor that stays (``nbytes``, the compute device), or, with a moved
tensor's host copy, a holder that counts the copy as ``offloaded_nbytes`` (host memory) while it lives.

A saved tensor counts while the graph that saved it is alive: the counter's pack hook hands autograd a small
holder and learns when autograd drops it. The figure is the most bytes alive at once (the end of the forward).
Graphs that die before backward (peft's DoRA builds ``lora_B(lora_A(eye))`` and keeps only its detached result)
held their tensors for an op or two, not until backward, and a freed storage's address, which a later storage
may take, is forgotten when it dies rather than mistaken for one already counted.

Not seen: tensors a custom autograd function keeps as plain attributes instead of ``save_for_backward``.
bitsandbytes' 4-bit matmul keeps its input that way; that input is usually alive anyway (the layer's LoRA
branch and the residual stream hold it), but where nothing else does, the figure misses it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from pl_lowprec.memory.breakdown import StorageSet

_ACTIVE: list[SavedTensorCounter] = []


class _Live:
    """Bytes held by holders alive now, and the most ever alive at once; ``on_free(key)`` when a key's last dies."""

    def __init__(self, on_free: Callable[[object], None] = lambda key: None) -> None:
        self._entries: dict[object, list[int]] = {}  # key -> [holders alive, bytes]
        self._on_free = on_free
        self.nbytes = 0
        self.peak = 0

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def hold(self, key: object, size: int = 0) -> None:
        """One more holder of ``key``; the first holder of a new key adds its ``size``."""
        entry = self._entries.get(key)
        if entry is not None:
            entry[0] += 1
            return
        self._entries[key] = [1, size]
        self.nbytes += size
        self.peak = max(self.peak, self.nbytes)

    def release(self, key: object) -> None:
        entry = self._entries[key]
        entry[0] -= 1
        if not entry[0]:
            del self._entries[key]
            self.nbytes -= entry[1]
            self._on_free(key)


class _Saved:
    """What autograd (or an offloaded tensor's host copy) holds instead of a counted tensor: its death says the
    graph that saved the tensor is gone. ``tensor`` may be another counter's holder (nested counters)."""

    __slots__ = ("key", "live", "tensor")

    def __init__(self, tensor: object, live: _Live, key: object, size: int = 0) -> None:
        self.tensor, self.live, self.key = tensor, live, key
        live.hold(key, size)

    def __del__(self) -> None:
        self.live.release(self.key)


def unpack_saved(saved: object) -> object:
    """The tensor inside the holders ``SavedTensorCounter.hold`` returned, or ``saved`` itself."""
    while isinstance(saved, _Saved):
        saved = saved.tensor
    return saved


class SavedTensorCounter:
    """Counts unique saved-tensor storages; read ``nbytes`` (device) and ``offloaded_nbytes`` (host) after the
    forward pass. ``nbytes``: the tensors reported by checkpointing (held until backward), plus the most bytes
    saved and alive at once. ``offloaded_nbytes``: the most bytes of host copies alive at once."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._storages = StorageSet(exclude)
        self._on_device: dict[int, int] = {}
        self._noted = 0  # reported by checkpointing, held until backward
        self._live = _Live(self._storages.forget_address)  # by storage address: a later storage may take it
        self._on_host = _Live()  # by move: each host copy its own key
        self.largest = 0  # the largest storage kept on the device: a weight-sized one would show here

    @property
    def nbytes(self) -> int:
        return self._noted + self._live.peak

    @property
    def offloaded_nbytes(self) -> int:
        return self._on_host.peak

    def add(self, tensor: object) -> None:
        """Count ``tensor``'s storage until backward (a checkpointed block's input, a kept op output)."""
        size = self._storages.nbytes(tensor)
        if size:
            self._on_device[tensor.untyped_storage()._cdata] = size
            self._noted += size
            self.largest = max(self.largest, size)

    def hold(self, tensor: object) -> object:
        """What autograd should keep for a saved ``tensor``: a holder that counts its storage while alive, or the
        tensor itself where there is nothing to follow (counted until backward: a tensor subclass's inner storages;
        not counted: a parameter's, a sparse layout, already reported by checkpointing, a save made during
        backward). ``tensor`` may be another counter's holder."""
        if in_backward():
            return tensor
        inner = unpack_saved(tensor)
        if not isinstance(inner, torch.Tensor) or inner.layout != torch.strided or is_traceable_wrapper_subclass(inner):
            self.add(inner)
            return tensor
        key = inner.untyped_storage()._cdata
        if key in self._live:  # saved again while alive: one more holder, no more bytes
            return _Saved(tensor, self._live, key)
        size = self._storages.nbytes(inner)
        if not size:  # a parameter's, or reported by checkpointing
            return tensor
        self.largest = max(self.largest, size)
        return _Saved(tensor, self._live, key, size)

    def hold_offloaded(self, tensor: torch.Tensor) -> object:
        """A host copy of ``tensor`` was made: its storage no longer stays on the device for backward. Returns a
        holder for the host copy to keep: its bytes count while it lives."""
        # Counted on the device before it moved (a checkpointed block's input)? Not any more. Its device storage
        # is freed after the copy, and a new one may take its address: forget it.
        self._noted -= self._on_device.pop(tensor.untyped_storage()._cdata, 0)
        self._storages.forget(tensor)
        return _Saved(None, self._on_host, object(), tensor.numel() * tensor.element_size())


def in_backward() -> bool:
    """Whether autograd's backward is running: reentrant checkpointing recomputes each block there, without hooks
    of its own, and those saves live for one block's backward; the figure is the forward's (as the estimate, whose
    manual-optimization step runs ``manual_backward`` inside its count, and ``MemoryTracker`` read it)."""
    return torch._C._current_graph_task_id() != -1


@contextmanager
def count_saved_tensors(model: nn.Module | None = None) -> Iterator[SavedTensorCounter]:
    """Count the bytes saved for backward inside the block, excluding ``model``'s parameters and buffers."""
    exclude = [*model.parameters(), *model.buffers()] if model is not None else []
    counter = SavedTensorCounter(exclude)
    _ACTIVE.append(counter)
    try:
        with torch.autograd.graph.saved_tensors_hooks(counter.hold, unpack_saved):
            yield counter
    finally:
        _ACTIVE.remove(counter)


def note_checkpoint_inputs(tensors: Iterable[object]) -> None:
    """Called by checkpointed forwards: their inputs are what they keep for backward."""
    if not _ACTIVE:
        return
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):
            for counter in _ACTIVE:
                counter.add(tensor)


def note_kept_outputs(output: object) -> None:
    """Called by selective checkpointing's policy for each op output it keeps for backward."""
    if _ACTIVE:
        note_checkpoint_inputs(tree_leaves(output))


def note_saved(tensor: torch.Tensor, offloaded: bool = False) -> object:
    """Called by activation offloading for each tensor autograd saves, moved to host or not. Returns what to keep
    so that the counters see when it dies: for a tensor that stays, what autograd keeps instead of it (``unpack_saved``
    gives the tensor back); for a moved one, what its host copy keeps. Nothing is counted during backward
    (``in_backward``)."""
    if in_backward():
        return [] if offloaded else tensor
    if offloaded:
        return [counter.hold_offloaded(tensor) for counter in _ACTIVE]
    kept: object = tensor
    for counter in _ACTIVE:
        kept = counter.hold(kept)
    return kept
