"""Peak and current memory of the device or process, with a reset so that each stage reports its own peak.

CUDA: ``torch.cuda`` max allocated and max reserved. CPU: the process's resident set, current (``VmRSS``) and
peak (``VmHWM``) from ``/proc/self/status``; on Linux writing ``5`` to ``/proc/self/clear_refs`` resets the peak.
Where that reset is not possible the CPU peak is the peak since the process started, and ``peak_is_per_stage``
says so.
"""

from __future__ import annotations

import resource
import sys
from pathlib import Path

import torch

_STATUS = Path("/proc/self/status")
_CLEAR_REFS = Path("/proc/self/clear_refs")


def _status_bytes(*fields: str) -> dict[str, int]:
    """Fields of one read of ``/proc/self/status``, in bytes (empty where unavailable)."""
    try:
        lines = _STATUS.read_text().splitlines()
    except OSError:
        return {}
    return {f: int(line.split()[1]) * 1024 for line in lines for f in fields if line.startswith(f + ":")}


def reset_peak(device: torch.device) -> bool:
    """Reset the peak statistics of ``device``; return whether the reset took effect."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        _CLEAR_REFS.write_text("5")
        return True
    except OSError:
        return False


def memory_stats(device: torch.device) -> dict[str, int]:
    """Flat dict of byte counts: ``cuda_max_allocated``/``cuda_max_reserved`` or ``rss_peak``/``rss_current``."""
    if device.type == "cuda":
        return {
            "cuda_max_allocated": torch.cuda.max_memory_allocated(device),
            "cuda_max_reserved": torch.cuda.max_memory_reserved(device),
            "cuda_allocated": torch.cuda.memory_allocated(device),
        }
    status = _status_bytes("VmHWM", "VmRSS")
    current = status.get("VmRSS", 0)
    peak = status.get("VmHWM")
    if peak is None:  # not Linux: ru_maxrss is kB on Linux, bytes on macOS
        scale = 1 if sys.platform == "darwin" else 1024
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale
    return {"rss_peak": max(peak, current), "rss_current": current}


_MEMINFO = Path("/proc/meminfo")


def available_memory(device: torch.device) -> int | None:
    """Bytes a run on ``device`` can still take: free CUDA memory (``torch.cuda.mem_get_info``, what other
    processes and this one's CUDA context leave), or on CPU the host's ``MemAvailable`` (``/proc/meminfo``: free
    memory plus what the kernel can reclaim). ``None`` where it cannot be read."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    try:
        lines = _MEMINFO.read_text().splitlines()
    except OSError:
        return None
    return next((int(line.split()[1]) * 1024 for line in lines if line.startswith("MemAvailable:")), None)
