"""Parameter bytes by kind: an FSDP2 shard (a DTensor) is counted as what its local tensor holds."""

import pytest
import torch
from torch import nn

from pl_lowprec.memory.breakdown import parameter_bytes


def test_sharded_parameters_are_keyed_by_their_local_kind(tmp_path):
    """FSDP2 wraps every parameter in a DTensor; the memory table put LoRA's fp32, the bf16 embeddings and the NF4
    weights all under one ``params_quantized_DTensor`` row."""
    pytest.importorskip("torchao")
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from pl_lowprec._imports import import_torchao_nf4
    from pl_lowprec.transforms.nf4 import nf4_bytes

    nf4 = import_torchao_nf4()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))

        def sharded(tensor, trainable):
            return nn.Parameter(DTensor.from_local(tensor, mesh, [Shard(0)]), requires_grad=trainable)

        model = nn.Module()
        model.embed = sharded(torch.zeros(64, 16, dtype=torch.bfloat16), False)
        model.lora = sharded(torch.zeros(8, 16), True)
        model.base = sharded(nf4.to_nf4(torch.randn(64, 64, dtype=torch.bfloat16), 64, 32), False)
        held = parameter_bytes(model)
        assert held == {"bfloat16": 64 * 16 * 2, "float32": 8 * 16 * 4, "quantized_4bit": nf4_bytes(model.base)}
        assert nf4_bytes(model.base) < 64 * 64  # 4 bits a weight and its constants, not the logical bf16 bytes
    finally:
        dist.destroy_process_group()


def test_a_plain_model_is_keyed_by_dtype():
    model = nn.Linear(4, 3).to(torch.bfloat16)
    assert parameter_bytes(model) == {"bfloat16": (4 * 3 + 3) * 2}
