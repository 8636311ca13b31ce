"""Destroy the process group when the process exits.

Lightning registers this only for NCCL. A gloo group still alive at interpreter exit lets its worker threads be
destroyed while joinable, and a run that trained and saved everything ends with "terminate called without an
active exception" (exit code -6) on one of its ranks, nondeterministically.
"""

from __future__ import annotations

import atexit

import torch.distributed as dist

_registered = False


def destroy_process_group_at_exit() -> None:
    """Register, once per process, the destruction of the default process group at interpreter exit."""
    global _registered
    if not _registered:
        atexit.register(_destroy_default_process_group)
        _registered = True


def _destroy_default_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
