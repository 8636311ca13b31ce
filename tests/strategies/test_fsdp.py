"""LowPrecisionFSDPStrategy on 2 CPU processes (gloo): sharded NF4 QLoRA trains like 1 process on the same batch."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("torchao")
pytest.importorskip("peft")
pytest.importorskip("transformers")

SCRIPT = Path(__file__).with_name("fsdp_train.py")


def _run(world, out, precision, scenario, device="cpu"):
    out.mkdir(parents=True)
    result = subprocess.run(
        [sys.executable, str(SCRIPT), str(world), str(out), precision, scenario, device],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return [torch.load(out / f"rank{rank}.pt", weights_only=False, map_location="cpu") for rank in range(world)]


def _assert_all_close(actual, expected, **tolerance):
    assert sorted(actual) == sorted(expected)
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], **tolerance, msg=lambda m, k=key: f"{k}: {m}")


@pytest.fixture(scope="module")
def fp32_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp32")
    sharded = _run(2, root / "train", "32-true", "train")
    single = _run(1, root / "single", "32-true", "train")[0]
    resumed = _run(2, root / "resume", "32-true", "resume")
    return sharded, single, resumed


@pytest.mark.slow
def test_meta_module_filled_from_pretrained_trains_like_a_built_one(fp32_runs, tmp_path):
    sharded, _, _ = fp32_runs
    loaded = _run(2, tmp_path / "pretrained", "32-true", "pretrained")
    for built, rank in zip(sharded, loaded, strict=True):
        _assert_all_close(rank["adapters"], built["adapters"], rtol=0, atol=0)


@pytest.mark.slow
def test_sharded_forward_equals_unsharded_nf4_forward(fp32_runs):
    sharded, _, _ = fp32_runs
    for rank in sharded:
        torch.testing.assert_close(rank["sharded_logits"], rank["unsharded_logits"], rtol=0, atol=0)


@pytest.mark.slow
def test_gradients_and_adapters_equal_one_process(fp32_runs):
    sharded, single, _ = fp32_runs
    assert len(single["grads"]) == 2 * 7 * 2  # A and B of 7 linear layers in each of 2 decoder layers
    for rank in sharded:
        # same global batch: averaged, not summed, across the ranks (SGD would double a summed gradient)
        _assert_all_close(rank["grads"], single["grads"], rtol=1e-5, atol=1e-7)
        _assert_all_close(rank["adapters"], single["adapters"], rtol=1e-4, atol=1e-6)
    assert all(single["adapters"][k].abs().max() > 0 for k in single["adapters"] if "lora_B" in k)  # trained


@pytest.mark.slow
def test_each_rank_holds_half_the_nf4_weights(fp32_runs):
    sharded, single, _ = fp32_runs
    ratios = [rank["nf4_bytes"] / single["nf4_bytes"] for rank in sharded]
    # the data, scales and factors split in two; the per-tensor mean and the 16-entry table are replicated
    assert all(0.5 <= r < 0.52 for r in ratios), ratios


@pytest.mark.slow
def test_adapter_only_resume_equals_uninterrupted_run(fp32_runs):
    sharded, _, resumed = fp32_runs
    for uninterrupted, rank in zip(sharded, resumed, strict=True):
        _assert_all_close(rank["adapters"], uninterrupted["adapters"], rtol=0, atol=0)


@pytest.mark.slow
def test_merged_weights_and_exported_adapter_equal_one_process(fp32_runs):
    sharded, single, _ = fp32_runs
    for rank in sharded:
        _assert_all_close(rank["merged"], single["merged"], rtol=1e-4, atol=1e-6)
    from safetensors.torch import load_file

    expected = load_file(Path(single["export"]) / "adapter_model.safetensors")
    for rank in sharded:
        _assert_all_close(load_file(Path(rank["export"]) / "adapter_model.safetensors"), expected, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_full_gathered_checkpoint_resumes_exactly(tmp_path):
    for rank in _run(2, tmp_path / "full", "32-true", "full"):
        assert "model.model.embed_tokens.weight" in rank["saved_keys"]  # the frozen base is in it, whole
        assert any("lora_B" in k for k in rank["saved_keys"])
        _assert_all_close(rank["resumed"], rank["uninterrupted"], rtol=0, atol=0)


@pytest.mark.slow
def test_bf16_mixed_gradients_equal_one_process(tmp_path):
    sharded = _run(2, tmp_path / "fsdp", "bf16-mixed", "train")
    single = _run(1, tmp_path / "single", "bf16-mixed", "train")[0]
    for rank in sharded:
        assert all(g.dtype == torch.float32 for g in rank["grads"].values())  # adapters train in fp32
        # bf16 matmuls on half the rows sum in another order: equal to bf16 rounding
        _assert_all_close(rank["grads"], single["grads"], rtol=0.02, atol=1e-4)
        _assert_all_close(rank["adapters"], single["adapters"], rtol=0.02, atol=2e-3)


@pytest.mark.slow
def test_fp16_overflow_on_one_rank_skips_the_step_on_both(tmp_path):
    ranks = _run(2, tmp_path / "overflow", "16-mixed", "overflow")
    for rank in ranks:
        # the inf sat in rank 1's shard only; the found-inf is all-reduced, so rank 0 skipped as well
        _assert_all_close(rank["after"], rank["before"], rtol=0, atol=0)
        assert rank["loss_scale"]["skipped_steps"] == 1
        assert rank["loss_scale"]["scale"] == 65536.0 / 2
    assert ranks[0]["loss_scale"] == ranks[1]["loss_scale"]
    _assert_all_close(ranks[0]["after"], ranks[1]["after"], rtol=0, atol=0)


@pytest.mark.slow
def test_bad_inputs_fail_before_the_first_step(tmp_path):
    for rank in _run(2, tmp_path / "bad", "32-true", "bad"):
        assert "shard_modules: 'DecoderBlock' matches no module" in rank["unknown_unit"]
        assert "LlamaDecoderLayer" in rank["unknown_unit"]  # lists the model's classes
        assert "pass shard_modules=" in rank["no_unit"] and "LlamaDecoderLayer" in rank["no_unit"]
        message = rank["block_split"]
        assert "scale group(s) do not split evenly across 2 ranks" in message and "nf4_scaler_block_size=32" in message
        assert "cpu_offload=True moves sharded parameters off the GPU; the ranks run on cpu" in rank["cpu_offload"]
        assert all(rank[f"{case}_steps"] == 0 for case in ("unknown_unit", "no_unit", "block_split", "cpu_offload"))


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("device", ["gpu", "gpu-offload"])
def test_nccl_and_cpu_offload_train_like_one_gpu(tmp_path, device):
    sharded = _run(2, tmp_path / "fsdp", "bf16-mixed", "train", device)
    single = _run(1, tmp_path / "single", "bf16-mixed", "train", "gpu")[0]
    for rank in sharded:
        torch.testing.assert_close(rank["sharded_logits"], rank["unsharded_logits"], rtol=1e-3, atol=1e-3)
        _assert_all_close(rank["adapters"], single["adapters"], rtol=0.02, atol=2e-3)
        assert 0.5 <= rank["nf4_bytes"] / single["nf4_bytes"] < 0.52
