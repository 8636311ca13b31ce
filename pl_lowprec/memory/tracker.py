"""``StepTracker``: follows each tensor storage of a fake training step from creation to free.

A ``TorchDispatchMode`` sees every op's outputs; each new storage is counted until its weakref finalizer runs,
so every temporary lives exactly as long as it does in the real run (backward's temporaries, each checkpointed
block's recompute, the loss's fp32 logits, the optimizer step's temporaries). Checked against PyTorch's profiler
allocation records (``docs/design/peak-memory-research.md``): within 0.3% on 15 configurations.

Categories: weights (parameters and buffers), gradients (moved there by a post-accumulate-grad hook),
optimizer state (moved there after the step), inputs, activations (made in forward, or in a checkpointed
block's recompute), temporaries (everything else made in backward and the optimizer step). Under DDP's
``gradient_as_bucket_view=True`` the gradients are views into its buckets (counted by the caller as held
throughout): a gradient the backward makes is counted until its accumulation hook, where DDP's reducer copies it
into its bucket and drops it, and the gradients held at the step start are not counted again.

Three pieces follow ``torch.distributed._tools.mem_tracker``: a DTensor is counted as its local shard, FSDP2's
``storage.resize_`` (which no dispatch mode sees) is followed, and DTensor ops are left to DTensor, whose local
ops are then seen. Not seen: scratch that kernels allocate outside tensor storages (oneDNN, cuBLAS workspaces).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from pl_lowprec.memory.input_buffer import sums_gradients_of_a_parameter

if TYPE_CHECKING:
    from pl_lowprec.memory.op_counts import OpCounter

CATEGORIES = ("weights", "gradients", "optimizer_state", "inputs", "activations", "temporaries")
IN_BUCKET = "in DDP's bucket"  # a gradient stored in DDP's bucket (gradient_as_bucket_view): not counted here
CUDA_BLOCK = 512  # the CUDA caching allocator rounds every request up to a multiple of 512 bytes

# What a fake step reads where code asks a tensor for its value (``.item()``, ``if (mask).all()``): False for
# booleans (no chunk of the batch is all padding: the estimate assumes unpadded batches), 1 otherwise.
_ASSUMED_VALUES: dict[torch.dtype, Any] = {torch.bool: False}

# op -> the composite implementation the real backend runs, so its temporaries are seen (memory/bnb_standin.py)
DECOMPOSE: dict[Any, Callable[..., Any]] = {}


def allocated_bytes(nbytes: int, device_type: str) -> int:
    """What an allocation of ``nbytes`` takes on ``device_type``: CUDA's caching allocator rounds up to 512 B
    (``torch.cuda.memory_allocated`` counts the rounded size); the CPU allocator takes what was asked.
    Reserved CUDA memory adds the allocator's fragmentation on top, which no simulation predicts."""
    if device_type == "cuda" and nbytes > 0:
        return -(-nbytes // CUDA_BLOCK) * CUDA_BLOCK
    return nbytes


def _storages(tensor: torch.Tensor) -> Collection[torch.UntypedStorage]:
    """A plain (fake) tensor's one storage, read directly: this runs for every output of every op of the step.
    A wrapper subclass (a DTensor's local shard, NF4's inner tensors) is taken apart by torch's own helper."""
    if not is_traceable_wrapper_subclass(tensor):
        return (tensor.untyped_storage(),)
    return get_untyped_storages(tensor)


def _output_tensors(out: Any) -> list[Any]:
    """The leaves of an op's output, as ``tree_flatten`` gives them; a single tensor (most ops) without it."""
    if isinstance(out, torch.Tensor):
        return [out]
    return tree_flatten(out)[0]


class StepTracker(TorchDispatchMode):
    """Live bytes by category over a fake step; ``peak``, the category split at the peak, and a timeline.

    Args:
        model: Its parameters and buffers count as weights, the gradients they hold as gradients.
        optimizers: Their state counts as optimizer state (re-read after each ``phase("optimizer step")``).
        inputs: Tensors alive at the step start that are not the model's (the batch).
        device_type: ``"cuda"`` rounds every allocation as the caching allocator does.
        counter: Shown every op that runs on the device (``op_counts.OpCounter``: FLOPs, bytes, kernels).
        gradients_in_buckets: DDP's ``gradient_as_bucket_view=True``: gradients live in its buckets, not here.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizers: list[torch.optim.Optimizer] | None,
        inputs: list[torch.Tensor] = (),  # type: ignore[assignment]
        device_type: str = "cpu",
        counter: OpCounter | None = None,
        gradients_in_buckets: bool = False,
    ) -> None:
        super().__init__()
        self.device_type = device_type
        self.gradients_in_buckets = gradients_in_buckets
        self.counter = counter
        self.info: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> [bytes, category]
        self.current = dict.fromkeys(CATEGORIES, 0)
        self.total = 0
        self.phase_name = "forward"
        self.optimizers = optimizers or []
        for tensor in [*model.parameters(), *model.buffers()]:
            self._add(tensor, "weights")
        for param in model.parameters():  # the last step's, held until Lightning's zero_grad (fake_step.py)
            if param.grad is not None:
                self._add(param.grad, IN_BUCKET if gradients_in_buckets else "gradients")
        for tensor in inputs:
            self._add(tensor, "inputs")
        self._track_optimizer_state()
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._grad_hook) for p in model.parameters() if p.requires_grad
        ]
        self._shapes = {tuple(p.shape) for p in model.parameters() if p.requires_grad}  # input_buffer.py
        self._depth = 0
        self.host_total = self.host_peak = 0
        self._on_host = 0
        self.reset()

    def reset(self) -> None:
        """Start the record here: the peak and timeline count from the bytes live now."""
        self._track_optimizer_state()
        self.peak, self.peak_split, self.peak_phase = self.total, dict(self.current), "start"
        self.timeline: list[tuple[str, int, dict[str, int]]] = [("after load", self.total, dict(self.current))]
        self.phase_peaks: dict[str, tuple[int, dict[str, int]]] = {}
        self.samples: list[tuple[str, dict[str, int]]] = []  # one per op that changed the total, for the plot

    @contextmanager
    def on_host(self) -> Iterator[None]:
        """Storages made inside live in host memory (activation offloading's copies): counted in ``host_peak``,
        not in the device's ``total``."""
        self._on_host += 1
        try:
            yield
        finally:
            self._on_host -= 1

    def remove_hooks(self) -> None:
        for hook in self._hooks:
            hook.remove()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Mark what runs inside as ``name`` ("forward", "backward", "optimizer step")."""
        self.phase_name = name
        self._note_peak()  # the phase starts at the bytes live now, even if it allocates nothing
        try:
            yield
        finally:
            if name == "optimizer step":
                self._track_optimizer_state()

    # bookkeeping ----------------------------------------------------------------------------------------------
    def _add(self, tensor: torch.Tensor, category: str) -> None:
        for storage in _storages(tensor):
            if storage in self.info:
                continue
            if category == IN_BUCKET:  # counted by the caller, as DDP's buckets
                self.info[storage] = [storage.nbytes(), category]
                continue
            if category == "host":
                record = [storage.nbytes(), category]
                self.info[storage] = record
                weakref.finalize(storage, self._free, record)
                self.host_total += record[0]
                self.host_peak = max(self.host_peak, self.host_total)
                continue
            record = [allocated_bytes(storage.nbytes(), self.device_type), category]
            self.info[storage] = record
            weakref.finalize(storage, self._free, record)
            self.current[category] += record[0]
            self.total += record[0]

    def _free(self, record: list) -> None:
        if record[1] == IN_BUCKET:
            return
        if record[1] == "host":
            self.host_total -= record[0]
            return
        self.current[record[1]] -= record[0]
        self.total -= record[0]

    def _move(self, tensor: torch.Tensor, category: str) -> None:
        for storage in _storages(tensor):
            record = self.info.get(storage)
            if record is None:
                self._add(tensor, category)
            elif record[1] not in (category, "host", IN_BUCKET):
                self.current[record[1]] -= record[0]
                self.current[category] += record[0]
                record[1] = category

    def _grad_hook(self, param: torch.Tensor) -> None:
        if param.grad is None:
            return
        if self.gradients_in_buckets:
            self._into_bucket(param.grad)
        else:
            self._move(param.grad, "gradients")

    def _into_bucket(self, tensor: torch.Tensor) -> None:
        """DDP's reducer copies ``tensor`` into its bucket and drops it (the gradient is a bucket view from now)."""
        for storage in _storages(tensor):
            record = self.info.get(storage)
            if record is None:
                self._add(tensor, IN_BUCKET)
            elif record[1] not in (IN_BUCKET, "host"):
                self._free(record)
                record[1] = IN_BUCKET

    def _track_optimizer_state(self) -> None:
        for optimizer in self.optimizers:
            for state in optimizer.state.values():
                for value in state.values():
                    if isinstance(value, torch.Tensor):
                        self._move(value, "optimizer_state")

    def _note_peak(self) -> None:
        best = self.phase_peaks.get(self.phase_name)
        if best is None or self.total > best[0]:
            self.phase_peaks[self.phase_name] = (self.total, dict(self.current))
        if self.total > self.peak:
            self.peak, self.peak_split, self.peak_phase = self.total, dict(self.current), self.phase_name

    # FSDP2 frees and re-allocates unsharded parameters with storage.resize_, which no dispatch mode sees -------
    def __enter__(self) -> StepTracker:
        self._depth += 1
        if self._depth == 1:
            self._resize = torch.UntypedStorage.resize_
            tracker = self

            def resize_(storage: torch.UntypedStorage, size: int) -> Any:
                out = tracker._resize(storage, size)
                record = tracker.info.get(storage)
                if record is not None:
                    delta = allocated_bytes(storage.nbytes(), tracker.device_type) - record[0]
                    record[0] += delta
                    tracker.current[record[1]] += delta
                    tracker.total += delta
                    tracker._note_peak()
                return out

            torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            torch.UntypedStorage.resize_ = self._resize  # type: ignore[method-assign]
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if DTensor in types:  # DTensor runs its local ops, which are seen next
            return NotImplemented
        if func is torch.ops.aten._local_scalar_dense.default:  # .item(), bool(): fake tensors hold no values
            return _ASSUMED_VALUES.get(args[0].dtype, 1)
        if self.phase_name == "backward" and sums_gradients_of_a_parameter(func, args, kwargs, self._shapes):
            return args[0].add_(args[1])  # a tied weight's two gradients, summed in place as the engine does
        impl = DECOMPOSE.get(func)
        if impl is not None:  # the op's real composite implementation, so its temporaries are seen
            with self:
                return impl(*args, **(kwargs or {}))
        out = func(*args, **(kwargs or {}))
        if self.counter is not None and not self._on_host:  # offloading's copies overlap on a side stream
            self.counter.record(func, args, kwargs, out, self.phase_name == "optimizer step")
        before = self.total
        category = "activations" if self.phase_name == "forward" else "temporaries"
        if self._on_host:
            category = "host"
        for tensor in _output_tensors(out):
            if isinstance(tensor, torch.Tensor):
                self._add(tensor, category)
        if self.total != before:
            self._note_peak()
            self.samples.append((self.phase_name, dict(self.current)))
        return out
