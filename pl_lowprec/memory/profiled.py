"""The measured peak of a training step on CPU, from PyTorch's profiler allocation records (the ground truth that
``estimate_memory`` is checked against; it does not come from this package's own counters).

peak = the bytes of every live tensor storage at the step start (a walk of the objects the garbage collector
knows, with last step's gradients already set to None) + the running maximum of the allocation records of the
step. Measure step 2 or later (the optimizer state exists), one configuration per process: the profiler does not
see frees of storages allocated before it started, so the step must not free tensors that existed before it.
Allocations that bypass c10 (oneDNN or MKL scratch) are not tensor storages and are not counted.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile


def live_storage_bytes() -> int:
    """Bytes of every distinct live CPU tensor storage reachable from Python objects."""
    gc.collect()
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and not obj.is_meta and obj.device.type == "cpu":
                storage = obj.untyped_storage()
                seen[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, some subclasses)
            continue
    return sum(seen.values())


def _allocations(node: object, out: list[tuple[int, int]]) -> None:
    if node.tag == _EventType.Allocation and str(node.extra_fields.device) == "cpu":
        out.append((node.start_time_ns, node.extra_fields.alloc_size))
    for child in node.children:
        _allocations(child, out)


def measured_peak(step: Callable[[], None]) -> int:
    """Run ``step`` once under the profiler; return its peak of live CPU tensor bytes."""
    base = live_storage_bytes()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as prof:
        step()
    records: list[tuple[int, int]] = []
    for root in prof.profiler.kineto_results.experimental_event_tree():
        _allocations(root, records)
    running = peak = 0
    for _, size in sorted(records):
        running += size
        peak = max(peak, running)
    return base + peak
