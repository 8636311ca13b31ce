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
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore


@contextmanager
def fake_mesh(world_size: int) -> Iterator[Any]:
    """A 1-D CPU device mesh of ``world_size`` fake ranks, this process being rank 0; torn down on exit.

    Inside a distributed run (``memory_budget=`` under ``lowprec_fsdp``: every rank checks) the fake group is a
    new group over the run's ranks, which every rank creates at the same point, as ``new_group`` asks."""
    if dist.is_initialized():
        if dist.get_world_size() != world_size:
            raise ValueError(
                f"estimate_memory with sharding over {world_size} ranks, inside a run of {dist.get_world_size()}:"
                " estimate before the distributed run starts (or in a separate process)."
            )
        group = dist.new_group(backend="fake")
        try:
            yield DeviceMesh.from_group(group, "cpu")
        finally:
            dist.destroy_process_group(group)
        return
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield init_device_mesh("cpu", (world_size,))
    finally:
        dist.destroy_process_group()
