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

Not seen: tensors a custom autograd function keeps as plain attributes instead of ``save_for_backward``.
bitsandbytes' 4-bit matmul keeps its input that way; that input is usually alive anyway (the layer's LoRA
branch and the residual stream hold it), but where nothing else does, the figure misses it.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from pl_lowprec.memory.breakdown import StorageSet

_ACTIVE: list[SavedTensorCounter] = []


class SavedTensorCounter:
    """Accumulates unique saved-tensor storages; read ``nbytes`` (device) and ``offloaded_nbytes`` (host) after
    the forward pass."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()) -> None:
        self._storages = StorageSet(exclude)
        self._on_device: dict[int, int] = {}
        self.nbytes = 0
        self.largest = 0  # the largest storage kept on the device: a weight-sized one would show here
        self.offloaded_nbytes = 0

    def add(self, tensor: torch.Tensor) -> None:
        size = self._storages.nbytes(tensor)
        if size:
            self._on_device[tensor.untyped_storage()._cdata] = size
            self.nbytes += size
            self.largest = max(self.largest, size)

    def add_offloaded(self, tensor: torch.Tensor) -> None:
        """A host copy of ``tensor`` was made; its storage no longer stays on the device for backward."""
        # Counted on the device before it moved (a checkpointed block's input)? Not any more. Its device storage
        # is freed after the copy, and a new one may take its address: forget it.
        self.nbytes -= self._on_device.pop(tensor.untyped_storage()._cdata, 0)
        self._storages.forget(tensor)
        self.offloaded_nbytes += tensor.numel() * tensor.element_size()

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.add(tensor)
        return tensor


@contextmanager
def count_saved_tensors(model: nn.Module | None = None) -> Iterator[SavedTensorCounter]:
    """Count the bytes saved for backward inside the block, excluding ``model``'s parameters and buffers."""
    exclude = [*model.parameters(), *model.buffers()] if model is not None else []
    counter = SavedTensorCounter(exclude)
    _ACTIVE.append(counter)
    try:
        with torch.autograd.graph.saved_tensors_hooks(counter._pack, lambda t: t):
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
