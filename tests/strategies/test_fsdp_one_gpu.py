"""LowPrecisionFSDPStrategy on one CUDA GPU (NCCL, one rank): the NCCL path and CPU offload of parameters.

Two GPUs test the sharding itself (``test_fsdp.py``); one GPU still runs NCCL, the GPU NF4 path and
``cpu_offload=True``, whose parameters live on the host between uses.
"""

import pytest
import torch

pytest.importorskip("torchao")
from test_fsdp import _assert_all_close, _run

pytestmark = pytest.mark.cuda


def test_cpu_offload_on_one_gpu_trains_like_the_parameters_on_the_gpu(tmp_path):
    on_gpu = _run(1, tmp_path / "gpu", "bf16-mixed", "train", "gpu")[0]
    offloaded = _run(1, tmp_path / "offload", "bf16-mixed", "train", "gpu-offload")[0]
    for run in (on_gpu, offloaded):
        torch.testing.assert_close(run["sharded_logits"], run["unsharded_logits"], rtol=1e-3, atol=1e-3)
    assert any(v.abs().max() > 0 for k, v in on_gpu["adapters"].items() if "lora_B" in k)  # it trained
    _assert_all_close(offloaded["adapters"], on_gpu["adapters"], rtol=0, atol=1e-6)
    assert offloaded["nf4_bytes"] == on_gpu["nf4_bytes"]
