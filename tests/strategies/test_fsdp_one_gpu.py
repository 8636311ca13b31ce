"""LowPrecisionFSDPStrategy on one CUDA GPU (NCCL, one rank).

Two GPUs test the sharding itself (``test_fsdp.py``); one GPU still runs NCCL and the GPU NF4 path, and shows
that ``cpu_offload=True`` with one process is refused instead of leaving the parameters in host memory.
"""

import subprocess
import sys

import pytest
import torch

pytest.importorskip("torchao")
from test_fsdp import SCRIPT, _run

pytestmark = pytest.mark.cuda


def test_one_gpu_trains_through_nccl_like_the_unsharded_forward(tmp_path):
    run = _run(1, tmp_path / "gpu", "bf16-mixed", "train", "gpu")[0]
    torch.testing.assert_close(run["sharded_logits"], run["unsharded_logits"], rtol=1e-3, atol=1e-3)
    assert any(v.abs().max() > 0 for k, v in run["adapters"].items() if "lora_B" in k)  # it trained


def test_cpu_offload_with_one_process_is_refused(tmp_path):
    out = tmp_path / "offload"
    out.mkdir()
    args = [sys.executable, str(SCRIPT), "1", str(out), "bf16-mixed", "train", "gpu-offload"]
    result = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert result.returncode != 0
    assert "cpu_offload=True with one process: nothing is sharded" in result.stderr
    assert "Trainer(devices=2)" in result.stderr and "activation_offloading=True" in result.stderr
