"""The device mesh and DTensor helpers: what a rank holds of a tensor, and how to see the whole of it."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Shard


def data_parallel_mesh(device_type: str, world_size: int) -> Any:
    """A 1-D mesh over every rank (FSDP only, no tensor parallelism), on CPU as on CUDA.

    Its dimension is named ``"fsdp"``: peft sizes LoRA layers by the local shard of a DTensor weight on a mesh
    with any other name (tensor parallelism), and by the full layer on an ``"fsdp"`` mesh."""
    return init_device_mesh(device_type, (world_size,), mesh_dim_names=("fsdp",))


def is_sharded(model: nn.Module) -> bool:
    return any(isinstance(m, FSDPModule) for m in model.modules())


def full_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor gathered into one full tensor on every rank (a collective); any other tensor as it is."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def local_rows(tensor: torch.Tensor, mesh: Any) -> torch.Tensor:
    """This rank's rows of a full tensor (``torch.chunk`` along dim 0, as FSDP2 splits it), in their own storage,
    as a DTensor of the full shape. An NF4 tensor is chunked with its block scales and factors."""
    rows = _rows_of(tensor, mesh)
    own = tensor.new_zeros(rows.shape)  # a copy: a view would keep the full tensor's storage alive
    own.copy_(rows)
    return DTensor.from_local(own, mesh, [Shard(0)], run_check=False, shape=tensor.shape, stride=tensor.stride())


def empty_local_rows(param: torch.Tensor, mesh: Any, device: torch.device | str) -> torch.Tensor:
    """This rank's rows of ``param`` (on the meta device, read for its shape only) in uninitialized storage on
    ``device``, as a DTensor of the full shape: what ``local_rows`` keeps of it, without making the full tensor,
    for a load that copies every value in next."""
    rows = _rows_of(param, mesh)
    own = torch.empty(rows.shape, dtype=param.dtype, device=device)
    return DTensor.from_local(own, mesh, [Shard(0)], run_check=False, shape=param.shape, stride=param.stride())


def _rows_of(tensor: torch.Tensor, mesh: Any) -> torch.Tensor:
    """This rank's rows of ``tensor`` as FSDP2 splits it (``torch.chunk`` along dim 0, its padding left out): none
    where the rows run out before this rank."""
    world, rank = mesh.size(), mesh.get_local_rank()
    chunks = torch.chunk(tensor, world, dim=0)
    return chunks[rank] if rank < len(chunks) else tensor[:0]


def is_local_rows(tensor: torch.Tensor) -> bool:
    return hasattr(tensor, "placements")
