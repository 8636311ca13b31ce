"""Give the host memory a streaming load freed back to the system.

The load reads each tensor, quantizes or copies it, and frees the read buffer; glibc keeps those freed blocks in
its heap for reuse, so the process's resident memory stays near the load's peak for the whole run, on CPU and
on a GPU machine alike. ``malloc_trim(0)`` returns them. Elsewhere (macOS, Windows, musl) this is a no-op.

A file mapped for the whole load (a ``.bin`` shard, unpickled once) keeps every page read from it resident
while it is mapped; ``release_mapped_pages`` drops a tensor's pages once it is consumed (Linux).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys
from functools import cache

import torch


@cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def release_freed_host_memory() -> bool:
    """Return glibc's freed heap blocks to the system; ``True`` when memory was released."""
    libc = _libc()
    if libc is None:
        return False
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:  # not glibc
        return False
    return bool(trim(0))


def release_mapped_pages(tensor: torch.Tensor) -> bool:
    """Drop the resident pages that lie wholly inside ``tensor``'s storage, a read-only view of a private file
    mapping (``torch.load(mmap=True)``): nothing wrote them, so a later read takes them from the file again (the
    page cache), as the first read did. The partial pages at either end stay: a neighbour may use them. ``True``
    when pages were dropped; a no-op off Linux."""
    libc = _libc()
    storage = tensor.untyped_storage()
    if libc is None or storage.device.type != "cpu" or storage.nbytes() == 0:
        return False
    start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    first, last = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
    if last <= first:
        return False
    return libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), mmap.MADV_DONTNEED) == 0
