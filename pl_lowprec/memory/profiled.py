"""The measured peak of a training step on CPU, from PyTorch's profiler allocation records (the ground truth that
``estimate_memory`` is checked against; it does not come from this package's own counters).

peak = the bytes of every live tensor storage before the profiler starts (a walk of the objects the garbage
collector knows) + the running total of the allocation records from then on, at its highest inside the measured
step. The profiler does not see frees of storages allocated before it started, so whatever the measured step
frees must be made under it: ``before`` (step 1, say: it makes the gradients and the optimizer state that step 2
frees and keeps) runs under the profiler, outside the measured range. One configuration per process. Allocations
that bypass c10 (oneDNN or MKL scratch) are not tensor storages and are not counted.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile, record_function

MEASURED = "measured_step"


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


def _allocations(node: object, window: str, out: list[tuple[int, int]], windows: list[tuple[int, int]]) -> None:
    if node.tag == _EventType.Allocation and str(node.extra_fields.device) == "cpu":
        out.append((node.start_time_ns, node.extra_fields.alloc_size))
    elif node.name == window:
        windows.append((node.start_time_ns, node.end_time_ns))
    for child in node.children:
        _allocations(child, window, out, windows)


def peak_in_window(prof: profile, window: str) -> int:
    """The highest running total of ``prof``'s CPU allocation records inside the first ``record_function(window)``
    range, counted from the profiler's start (so the bytes it saw allocated and still live when the range opens are
    in it)."""
    records: list[tuple[int, int]] = []
    windows: list[tuple[int, int]] = []
    for root in prof.profiler.kineto_results.experimental_event_tree():
        _allocations(root, window, records, windows)
    start, end = windows[0]
    running = peak = 0
    for time, size in sorted(records):
        if time > end:
            break
        running += size
        peak = max(peak, running) if time >= start else running  # from the bytes live when the range opens
    return peak


def measured_peak(step: Callable[[], None], before: Callable[[], None] | None = None) -> int:
    """Run ``before`` (if given) then ``step`` under the profiler; return ``step``'s peak of live CPU tensor bytes."""
    base = live_storage_bytes()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=False) as prof:
        if before is not None:
            before()
        with record_function(MEASURED):
            step()
    return base + peak_in_window(prof, MEASURED)
