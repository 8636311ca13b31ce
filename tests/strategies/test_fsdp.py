"""LowPrecisionFSDPStrategy on 2 CPU processes (gloo): sharded NF4 QLoRA trains like 1 process on the same batch."""

import sys
from pathlib import Path

import pytest
import torch
import warm_python

pytest.importorskip("torchao")
pytest.importorskip("peft")
pytest.importorskip("transformers")

SCRIPT = Path(__file__).parents[1] / "_scripts" / "fsdp_train.py"
SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4, "max_len": 32}


def _run_many(world, out, precision, scenarios, device="cpu"):
    """One launch of ``world`` processes running ``scenarios`` in turn: {scenario: [result of each rank]}."""
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(SCRIPT), str(world), str(out), precision, ",".join(scenarios), device]
    result = warm_python.run(command, timeout=900, ranks=world)
    assert result.returncode == 0, result.stderr[-4000:]
    return {
        name: [torch.load(out / name / f"rank{r}.pt", weights_only=False, map_location="cpu") for r in range(world)]
        for name in scenarios
    }


def _run(world, out, precision, scenario, device="cpu"):
    return _run_many(world, out, precision, [scenario], device)[scenario]


def _assert_all_close(actual, expected, **tolerance):
    assert sorted(actual) == sorted(expected)
    for key in expected:
        torch.testing.assert_close(actual[key], expected[key], **tolerance, msg=lambda m, k=key: f"{k}: {m}")


# Every 2-process scenario at 32-true runs in one launch (each launch costs two imports of torch, Lightning and
# transformers on 2 cores): train first, then resume from its checkpoint, then the rest.
TWO_PROCESS = ["train", "resume", "pretrained", "pretrained_bin", "options", "full", "overflow", "bad", "compiled"]


@pytest.fixture(scope="module")
def two_process(tmp_path_factory):
    return _run_many(2, tmp_path_factory.mktemp("fsdp2"), "32-true", TWO_PROCESS)


@pytest.fixture(scope="module")
def fp32_runs(two_process, tmp_path_factory):
    single = _run(1, tmp_path_factory.mktemp("fsdp1") / "single", "32-true", "train")[0]
    return two_process["train"], single, two_process["resume"]


@pytest.mark.slow
def test_meta_module_filled_from_pretrained_or_initialized_holds_its_rows_only(fp32_runs, two_process):
    sharded, single, _ = fp32_runs
    loaded = two_process["pretrained"]
    for built, rank in zip(sharded, loaded, strict=True):
        _assert_all_close(rank["adapters"], built["adapters"], rtol=0, atol=0)
        # Never the whole 4-bit model on a rank: its rows of every layer loaded so far, plus the one layer being
        # quantized (measured: 25496 of 42456 live NF4 bytes; 42456, the whole model, when each rank kept the
        # full weights until fully_shard).
        peak, whole = max(rank["nf4_held_during_load"]), single["nf4_bytes"]
        assert peak <= rank["nf4_bytes"] + rank["largest_nf4_layer"], (peak, rank["nf4_bytes"])
        assert peak < 0.62 * whole, (peak, whole)
        # Built on meta without weights: each module's reset_parameters on full tensors, quantized, its rows kept;
        # equal to the module built whole from the same seed (measured peak: 21220 of 25524 live NF4 bytes, half
        # the model plus the largest layer, the 64x256 head).
        initialized = rank["initialized"]
        _assert_all_close(initialized["initial"], initialized["reference"], rtol=0, atol=0)
        peak = max(initialized["nf4_held_during_load"])
        assert peak <= initialized["nf4_bytes"] + initialized["largest_nf4_layer"], peak
        assert peak < initialized["whole_nf4_bytes"], peak


@pytest.mark.slow
def test_a_pytorch_model_bin_base_trains_as_its_safetensors_copy_under_fsdp(two_process):
    """The same base as pytorch_model.bin: every rank streams its rows from the mapped file, and the adapters
    after training equal those from the safetensors base, bit for bit (both in the module's one launch)."""
    runs = two_process
    for from_safetensors, from_bin in zip(runs["pretrained"], runs["pretrained_bin"], strict=True):
        assert "pytorch_model.bin" in from_bin["read"] and "model.safetensors" not in from_bin["read"]
        _assert_all_close(from_bin["adapters"], from_safetensors["adapters"], rtol=0, atol=0)


@pytest.mark.slow
def test_blocks_compiled_after_fully_shard_give_the_eager_gradients(two_process):
    # compile=True with checkpointed blocks, NF4 and LoRA under FSDP2: step 1's gradients equal train's (eager,
    # unchecked blocks; checkpointing changes no gradient) to fp32 reordering (measured: 1.1e-8 of 0.046).
    for eager, compiled in zip(two_process["train"], two_process["compiled"], strict=True):
        assert compiled["compiled"] == [True, True]
        _assert_all_close(compiled["grads"], eager["grads"], rtol=1e-4, atol=1e-6)


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
def test_exported_adapter_loads_in_peft_and_gives_the_single_process_logits(fp32_runs):
    from peft import PeftModel
    from safetensors.torch import load_file

    from pl_lowprec.demo import TinyLlama

    sharded, single, _ = fp32_runs
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))

    def peft_logits(export: str) -> torch.Tensor:
        base = TinyLlama(**SIZES).model  # the same base weights (init_seed=0), unquantized
        model = PeftModel.from_pretrained(base, export)
        loaded = {k.replace(".default", ""): v for k, v in model.state_dict().items() if "lora_" in k}
        _assert_all_close(loaded, load_file(Path(export) / "adapter_model.safetensors"), rtol=0, atol=0)
        with torch.no_grad():
            return model(input_ids=ids).logits

    expected = peft_logits(single["export"])
    with torch.no_grad():
        assert (expected - TinyLlama(**SIZES).model(input_ids=ids).logits).abs().max() > 1e-3  # the adapter acts
    for rank in sharded:
        torch.testing.assert_close(peft_logits(rank["export"]), expected, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def option_runs(two_process):
    return two_process["options"]


# What shows each option really ran under FSDP (the unsharded reference runs it too, so equal results alone would
# not): its layers, its optimizer state, its host copies, its dtype.
APPLIED = {
    "qat": lambda case: "FakeQuantizedLinear" in case["layers"],
    "fp8": lambda case: "Float8Linear" in case["layers"],
    "offloading": lambda case: case["offloaded_bytes"] > 0,
    "torchao_adamw8bit": lambda case: case["optimizer"] == "AdamW8bit" and case["state_types"] == ["OptimState8bit"],
    "bf16-true": lambda case: case["precision"] == "bf16-true" and case["dtypes"] == ["torch.bfloat16"],
}


@pytest.mark.slow
@pytest.mark.parametrize("option", ["qat", "fp8", "offloading", "torchao_adamw8bit"])
def test_option_under_fsdp_trains_like_the_unsharded_transform(option_runs, option):
    for rank in option_runs:
        case = rank[option]
        assert APPLIED[option](case), {k: v for k, v in case.items() if k not in ("sharded", "unsharded", "plain")}
        # measured: equal to the last bit (the reference splits each global batch as the sampler does)
        _assert_all_close(case["sharded"]["grads"], case["unsharded"]["grads"], rtol=1e-5, atol=1e-7)
        _assert_all_close(case["sharded"]["adapters"], case["unsharded"]["adapters"], rtol=1e-5, atol=1e-7)
        if option != "offloading":  # offloading moves bits, it does not change them
            plain = case["plain"]["adapters"]
            assert max((plain[k] - v).abs().max() for k, v in case["unsharded"]["adapters"].items()) > 1e-3


@pytest.mark.slow
def test_bf16_true_trains_sharded_like_one_process_within_bf16_rounding(option_runs):
    for rank in option_runs:
        case = rank["bf16-true"]
        assert APPLIED["bf16-true"](case)
        # measured: 2 bf16 ulps on the gradients (|g| < 0.06), 1e-3 on the adapters; 0.016 without NF4 and bf16
        _assert_all_close(case["sharded"]["grads"], case["unsharded"]["grads"], rtol=0.02, atol=1e-3)
        _assert_all_close(case["sharded"]["adapters"], case["unsharded"]["adapters"], rtol=0.02, atol=2e-3)


@pytest.mark.slow
def test_full_gathered_checkpoint_resumes_exactly(two_process):
    for rank in two_process["full"]:
        assert "model.model.embed_tokens.weight" in rank["saved_keys"]  # the frozen base is in it, whole
        assert any("lora_B" in k for k in rank["saved_keys"])
        _assert_all_close(rank["resumed"], rank["uninterrupted"], rtol=0, atol=0)


@pytest.mark.slow
def test_bf16_mixed_gradients_equal_one_process(tmp_path):
    sharded_runs = _run_many(2, tmp_path / "fsdp", "bf16-mixed", ["train", "biases"])
    single_runs = _run_many(1, tmp_path / "single", "bf16-mixed", ["train", "biases"])
    # bias='lora_only' on a streamed base: the biases train in fp32 on each rank's rows (they stayed bf16 under
    # an fp32 DTensor, and the reduce-scatter failed on mixed gradient dtypes), as on one process
    for rank in sharded_runs["biases"]:
        assert rank["local_dtypes"] == {"torch.float32"} and len(rank["biases"]) == 8
        assert rank["least_moved"] > 1e-4  # every bias trained
        _assert_all_close(rank["biases"], single_runs["biases"][0]["biases"], rtol=0.02, atol=2e-3)
    sharded, single = sharded_runs["train"], single_runs["train"][0]
    for rank in sharded:
        assert all(g.dtype == torch.float32 for g in rank["grads"].values())  # adapters train in fp32
        # bf16 matmuls on half the rows sum in another order: equal to bf16 rounding
        _assert_all_close(rank["grads"], single["grads"], rtol=0.02, atol=1e-4)
        _assert_all_close(rank["adapters"], single["adapters"], rtol=0.02, atol=2e-3)


@pytest.mark.slow
def test_fp16_overflow_on_one_rank_skips_the_step_on_both(two_process):
    ranks = two_process["overflow"]  # the scenario trains under 16-mixed whatever the launch's precision
    for rank in ranks:
        # the inf sat in rank 1's shard only; the found-inf is all-reduced, so rank 0 skipped as well
        _assert_all_close(rank["after"], rank["before"], rtol=0, atol=0)
        assert rank["loss_scale"]["skipped_steps"] == 1
        assert rank["loss_scale"]["scale"] == 65536.0 / 2
    assert ranks[0]["loss_scale"] == ranks[1]["loss_scale"]
    _assert_all_close(ranks[0]["after"], ranks[1]["after"], rtol=0, atol=0)


@pytest.mark.slow
def test_bad_inputs_fail_before_the_first_step(two_process):
    for rank in two_process["bad"]:
        assert "shard_modules: 'DecoderBlock' matches no module" in rank["unknown_unit"]
        assert "LlamaDecoderLayer" in rank["unknown_unit"]  # lists the model's classes
        message = rank["block_split"]
        assert "scale group(s) do not split evenly across 2 ranks" in message and "nf4_scaler_block_size=32" in message
        assert "cpu_offload=True moves sharded parameters off the GPU; the ranks run on cpu" in rank["cpu_offload"]
        assert all(rank[f"{case}_steps"] == 0 for case in ("unknown_unit", "block_split", "cpu_offload"))
        assert "have no reset_parameters(): model.model.layers.0.input_layernorm (LlamaRMSNorm)" in rank["no_reset"]
        assert "Pass pretrained=" in rank["no_reset"]
        said = rank["whole_weight_init"]
        assert "init_lora_weights='olora' decomposes each whole base weight" in said and "on 2 ranks" in said
        assert "Fix: strategy lowprec_ddp or one device" in said


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
