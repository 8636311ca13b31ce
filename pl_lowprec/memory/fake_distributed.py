"""A fake process group for estimating one rank of a sharded (FSDP2) run in this single process.

torch's ``fake`` backend (``FakeStore``) answers every collective at once without data, so ``fully_shard`` and
the all-gathers and reduce-scatters of a step run as on rank 0 of ``world_size``; each rank holds the same
shapes, so rank 0's peak is every rank's. Checked against a real 2-rank gloo run
(``docs/design/peak-memory-research.md``, Q6): the same bytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore


@contextmanager
def fake_mesh(world_size: int) -> Iterator[Any]:
    """A 1-D CPU device mesh of ``world_size`` fake ranks, this process being rank 0; torn down on exit."""
    if dist.is_initialized():
        raise ValueError(
            "estimate_memory with sharding builds its own fake process group, but one is already initialized in"
            " this process: estimate before the distributed run starts (or in a separate process)."
        )
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()
