"""Count the bytes that autograd keeps for backward: the activation memory of a training step.

``torch.autograd.graph.saved_tensors_hooks`` sees every tensor an op saves for its backward. Storages are
counted once, and storages shared with the model's parameters are left out (they are weights, not
activations). Activation checkpointing replaces a block's saved tensors with its inputs; the checkpointed
forward reports those inputs here (``note_checkpoint_inputs``), so the count stays the real one. Selective
checkpointing keeps some op outputs in its own cache, outside autograd's saved tensors; its policy reports them
here (``note_kept_outputs``).

Activation offloading (``pl_lowprec.transforms.offloading``) installs its own hooks inside the counter's, and only the
innermost hooks run; it reports each saved tensor here (``note_saved``) with where it went: moved tensors count
as ``offloaded_nbytes`` (host memory, one copy per move) instead of ``nbytes`` (the compute device).

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

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from pl_lowprec.memory.breakdown import StorageSet

_ACTIVE: list[SavedTensorCounter] = []


class _Saved:
    """What autograd holds instead of a counted tensor: its death says the graph that saved the tensor is gone."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def _unpack(saved: object) -> object:
    return saved.tensor if isinstance(saved, _Saved) else saved


class SavedTensorCounter:
    """Counts unique saved-tensor storages; read ``nbytes`` (device) and ``offloaded_nbytes`` (host) after the
    forward pass. ``nbytes``: the tensors reported by checkpointing and offloading (held until backward), plus the
    most bytes the counter's own hook saw saved and alive at once."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._storages = StorageSet(exclude)
        self._on_device: dict[int, int] = {}
        self._noted = 0  # reported by checkpointing and offloading, held until backward
        self._live: dict[int, list[int]] = {}  # storage address -> [holders alive, bytes]
        self._live_bytes = 0
        self._peak_live = 0
        self.largest = 0  # the largest storage kept on the device: a weight-sized one would show here
        self.offloaded_nbytes = 0

    @property
    def nbytes(self) -> int:
        return self._noted + self._peak_live

    def add(self, tensor: torch.Tensor) -> None:
        size = self._storages.nbytes(tensor)
        if size:
            self._on_device[tensor.untyped_storage()._cdata] = size
            self._noted += size
            self.largest = max(self.largest, size)

    def add_offloaded(self, tensor: torch.Tensor) -> None:
        """A host copy of ``tensor`` was made; its storage no longer stays on the device for backward."""
        # Counted on the device before it moved (a checkpointed block's input)? Not any more. Its device storage
        # is freed after the copy, and a new one may take its address: forget it.
        self._noted -= self._on_device.pop(tensor.untyped_storage()._cdata, 0)
        self._storages.forget(tensor)
        self.offloaded_nbytes += tensor.numel() * tensor.element_size()

    def _pack(self, tensor: torch.Tensor) -> object:
        if not isinstance(tensor, torch.Tensor) or is_traceable_wrapper_subclass(tensor):
            self.add(tensor)  # held as it is (a subclass's inner storages are counted until backward)
            return tensor
        key = tensor.untyped_storage()._cdata
        if key in self._live:
            self._live[key][0] += 1
        else:
            size = self._storages.nbytes(tensor)
            if not size:  # a parameter's, an uncounted layout, or reported by checkpointing
                return tensor
            self._live[key] = [1, size]
            self._live_bytes += size
            self._peak_live = max(self._peak_live, self._live_bytes)
            self.largest = max(self.largest, size)
        saved = _Saved(tensor)
        weakref.finalize(saved, self._release, key)
        return saved

    def _release(self, key: int) -> None:
        entry = self._live[key]
        entry[0] -= 1
        if not entry[0]:
            del self._live[key]
            self._live_bytes -= entry[1]
            self._storages.forget_address(key)  # a later storage may take it


@contextmanager
def count_saved_tensors(model: nn.Module | None = None) -> Iterator[SavedTensorCounter]:
    """Count the bytes saved for backward inside the block, excluding ``model``'s parameters and buffers."""
    exclude = [*model.parameters(), *model.buffers()] if model is not None else []
    counter = SavedTensorCounter(exclude)
    _ACTIVE.append(counter)
    try:
        with torch.autograd.graph.saved_tensors_hooks(counter._pack, _unpack):
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


def note_saved(tensor: torch.Tensor, offloaded: bool) -> None:
    """Called by activation offloading for each tensor autograd saves, moved to host or not."""
    for counter in _ACTIVE:
        if offloaded:
            counter.add_offloaded(tensor)
        else:
            counter.add(tensor)
