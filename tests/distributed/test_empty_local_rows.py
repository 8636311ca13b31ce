"""``mesh.empty_local_rows``: a rank's rows of a meta parameter, uninitialized, without the full tensor that
``local_rows`` copies them out of (a whole checkpoint's restore under FSDP2 fills them next). Each rank of 1, 2 and 3
(a fake process group: no collective runs) gets the DTensor ``local_rows`` gives, uneven shards and ranks past the
rows included."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pl_lowprec.distributed.mesh import data_parallel_mesh, empty_local_rows, local_rows

fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")


def _layout(tensor: torch.Tensor) -> tuple:
    local = tensor.to_local()
    return (
        tensor.placements,
        tensor.shape,
        tensor.stride(),
        tensor.dtype,
        local.shape,
        local.stride(),
        local.dtype,
        local.device,
        tensor.device_mesh.size(),
    )


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("shape", [(7, 5), (6, 4), (2, 3), (5,), (1, 8)])
def test_a_ranks_empty_rows_are_laid_out_as_local_rows_copies_them(world, shape):
    meta = torch.nn.Parameter(torch.empty(shape, dtype=torch.bfloat16, device="meta"), requires_grad=False)
    for rank in range(world):
        dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank, world_size=world)
        try:
            mesh = data_parallel_mesh("cpu", world)
            made = empty_local_rows(meta, mesh, torch.device("cpu"))
            copied = local_rows(torch.empty_like(meta, device="cpu"), mesh)
            assert _layout(made) == _layout(copied), (world, rank)
        finally:
            dist.destroy_process_group()
