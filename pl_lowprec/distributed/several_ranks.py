"""Whether this process runs beside other ranks: a started default process group of more than one rank."""

from __future__ import annotations

import torch.distributed as dist


def several_ranks() -> bool:
    """A default process group is started and holds more than one rank (else: one process, nothing to agree on)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
