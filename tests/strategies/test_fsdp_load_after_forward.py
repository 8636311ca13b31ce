"""A checkpoint loads into an FSDP2 model after a forward without backward (validate, test, predict, a fit's last
validation): the root unit keeps its weights gathered then, and the load wrote into the shards."""

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from pl_lowprec.strategies.fsdp_checkpoints import gathered_state_dict, load_full_state_dict


@pytest.mark.usefixtures("no_process_group_left")
def test_a_checkpoint_loads_after_a_forward_only_pass(tmp_path):
    # lowprec_fsdp stopped in "aten.copy_.default got mixed torch.Tensor and DTensor" at validate(ckpt_path="best")
    # after fit, and at lr_find's restore (measured on 2 gloo ranks); one rank has the same root unit.
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    fully_shard(model[0])
    fully_shard(model)
    saved = gathered_state_dict(model.state_dict())
    with torch.no_grad():
        model[2].weight.to_local().add_(1.0)  # moved away from the checkpoint
        model(torch.randn(3, 4))  # the root unit (model[2]) stays gathered
    load_full_state_dict(model, saved, adapter_only=False)
    for key, value in gathered_state_dict(model.state_dict()).items():
        torch.testing.assert_close(value, saved[key], rtol=0, atol=0)
