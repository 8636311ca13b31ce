"""LowPrecisionDDPStrategy on 2 CPU processes (gloo) trains to the parameters of 1 process on the same batch."""

import sys
from pathlib import Path

import pytest
import torch
import warm_python

SCRIPT = Path(__file__).parents[1] / "_scripts" / "ddp_train.py"


def _run(mode, out, precision, variant="gpt", accelerator="cpu"):
    out.mkdir()
    command = [sys.executable, str(SCRIPT), mode, str(out), precision, variant, accelerator]
    result = warm_python.run(command, 300, ranks=2 if mode == "ddp" else 1)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "all_gather is deprecated" not in result.stderr  # MemoryTracker's gather: torch 2.13 warned on each rank
    return {p.name: torch.load(p, weights_only=False) for p in sorted(out.glob("rank*.pt"))}


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["32-true", "16-mixed"])
def test_ddp_matches_single_process(tmp_path, precision):
    ddp = _run("ddp", tmp_path / "ddp", precision)
    single = _run("single", tmp_path / "single", precision)["rank0.pt"]
    assert sorted(ddp) == ["rank0.pt", "rank1.pt"]
    for rank in ddp.values():
        assert rank["_checkpointed"] == ["CheckpointedForward"] * 2
        assert rank["_loss_scale"] == single["_loss_scale"]
        # MemoryTracker gathered every rank: same summary everywhere, parameters counted once per rank
        assert rank["_memory"]["world_size"] == 2
        assert rank["_memory"] == ddp["rank0.pt"]["_memory"]
        assert rank["_memory"]["bytes"]["params_float32"] == single["_memory"]["bytes"]["params_float32"]
    params = [k for k in single if not k.startswith("_")]
    for key in params:
        torch.testing.assert_close(ddp["rank0.pt"][key], ddp["rank1.pt"][key], rtol=0, atol=0)  # ranks agree
        torch.testing.assert_close(ddp["rank0.pt"][key], single[key])


@pytest.mark.slow
def test_qlora_ddp_keeps_adapters_identical_across_ranks(tmp_path):
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    ddp = _run("ddp", tmp_path / "ddp", "bf16-mixed", "qlora")
    single = _run("single", tmp_path / "single", "bf16-mixed", "qlora")["rank0.pt"]
    adapters = [k for k in single if "lora_" in k]
    assert len(adapters) == 2 * 7 * 2  # A and B for 7 linear layers in each of 2 decoder layers
    for rank in ddp.values():
        assert rank["_checkpointed"] == ["CheckpointedForward"] * 2
        assert set(rank) == set(single)
    # memory_budget predicted the step; on 2 ranks with DDP's all-reduce of the adapters' gradients (one bucket),
    # timed on the run's own gloo group: the same figures on both ranks (the slowest rank's)
    gradient_bytes = sum(single[key].numel() * 4 for key in adapters)
    assert single["_step_time"]["collectives"] == 0 and single["_step_time"]["communication"] == 0
    for rank in ddp.values():
        step = rank["_step_time"]
        assert step["collectives"] == 1 and step["wire_bytes"] == gradient_bytes  # 2 (n-1)/n of it, n = 2
        assert step["interconnect"] == "gloo between 2 ranks, measured"
        assert 0 < step["communication"] == ddp["rank0.pt"]["_step_time"]["communication"]
    for key in adapters:
        assert "lora_A" in key or ddp["rank0.pt"][key].abs().max() > 0  # B starts at zero: it trained
        torch.testing.assert_close(ddp["rank0.pt"][key], ddp["rank1.pt"][key], rtol=0, atol=0)  # identical
        # same global batch as one process: equal up to the summation order of bf16/4-bit matmuls
        torch.testing.assert_close(ddp["rank0.pt"][key], single[key], rtol=0.02, atol=2e-3)


@pytest.mark.slow
def test_compiled_qlora_ddp_trains_like_eager_on_one_process(tmp_path):
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    ddp = _run("ddp", tmp_path / "ddp", "32-true", "qlora-compiled")
    single = _run("single", tmp_path / "single", "32-true", "qlora")["rank0.pt"]
    assert single["_compiled"] == [False, False]
    adapters = [k for k in single if "lora_" in k]
    for rank in ddp.values():
        assert rank["_compiled"] == [True, True] and rank["_checkpointed"] == ["CheckpointedForward"] * 2
    for key in adapters:
        torch.testing.assert_close(ddp["rank0.pt"][key], ddp["rank1.pt"][key], rtol=0, atol=0)
        # compiled bitsandbytes 4-bit blocks on 2 ranks, 4 SGD steps: eager's adapters to fp32 reordering
        torch.testing.assert_close(ddp["rank0.pt"][key], single[key], rtol=1e-4, atol=1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_memory_tracker_gathers_across_two_gpus_with_nccl(tmp_path):
    # NCCL rejects CPU tensors: before the fix, the end-of-fit gather of MemoryTracker crashed here.
    ddp = _run("ddp", tmp_path / "ddp", "16-mixed", accelerator="gpu")
    assert sorted(ddp) == ["rank0.pt", "rank1.pt"]
    for rank in ddp.values():
        assert rank["_memory"]["device"] == "cuda" and rank["_memory"]["world_size"] == 2
        assert rank["_memory"] == ddp["rank0.pt"]["_memory"]
        assert rank["_memory"]["bytes"]["cuda_max_allocated"] > 0


@pytest.mark.slow
def test_qat_ddp_converts_identically_on_every_rank(tmp_path):
    pytest.importorskip("torchao")
    ddp = _run("ddp", tmp_path / "ddp", "32-true", "qat")
    single = _run("single", tmp_path / "single", "32-true", "qat")["rank0.pt"]
    quantized = [k for k, v in single.items() if hasattr(v, "qdata")]
    assert len(quantized) == 4  # the two MLP layers of each block
    for key in quantized:
        rank0, rank1 = ddp["rank0.pt"][key], ddp["rank1.pt"][key]
        assert torch.equal(rank0.qdata, rank1.qdata) and torch.equal(rank0.scale, rank1.scale)
        # same global batch as one process: a weight on a rounding boundary may land one int4 step away
        step = single[key].scale.max().item()
        torch.testing.assert_close(rank0.dequantize(), single[key].dequantize(), rtol=0, atol=step * 1.01)
