"""Give the host memory a streaming load freed back to the system.

The load reads each tensor, quantizes or copies it, and frees the read buffer; glibc keeps those freed blocks in
its heap for reuse, so the process's resident memory stays near the load's peak for the whole run, on CPU and
on a GPU machine alike. ``malloc_trim(0)`` returns them. Elsewhere (macOS, Windows, musl) this is a no-op.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys


def release_freed_host_memory() -> bool:
    """Return glibc's freed heap blocks to the system; ``True`` when memory was released."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return False
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:  # not glibc
        return False
    return bool(trim(0))
