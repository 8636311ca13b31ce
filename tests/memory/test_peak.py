"""estimate_memory's peak: against the profiler's allocation records (one fresh process each), where it falls,
the CUDA allocator's rounding, and real model shapes from a config.json alone."""

import functools
import json
import sys
import warnings
from pathlib import Path

import pytest
import torch
import warm_python
from model_shapes import SMOLLM2_135M

from pl_lowprec import estimate_memory
from pl_lowprec.demo import TinyLlama
from pl_lowprec.memory.tracker import allocated_bytes

ROOT = Path(__file__).resolve().parents[2]
TINY = {"hidden": 64, "layers": 2, "batch_size": 2, "seq_len": 64}


def _measured_and_predicted(name: str) -> dict:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from peak_memory import run_one_process  # a fresh process: the profiler's base must see only this run
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    return run_one_process(name, warm_python.run, **TINY)


@pytest.mark.parametrize("name", ["qlora fp32 ckpt", "fsdp qlora fp32 ckpt, 2 ranks (per rank)"])
def test_predicted_peak_is_within_ten_percent_of_the_profiler(name):
    pytest.importorskip("bitsandbytes")
    row = _measured_and_predicted(name)
    assert abs(row["error"]) < 0.10, row
    assert row["peak_phase"] == "backward", row


def _tiny_llama_estimate(**settings):
    build = functools.partial(TinyLlama, hidden_size=64, intermediate_size=128, num_layers=2, max_len=64)
    return estimate_memory(build, {"input_ids": torch.zeros(2, 64, dtype=torch.long)}, **settings)


def test_the_peak_is_the_largest_point_of_the_timeline_and_the_table_says_so():
    estimate = _tiny_llama_estimate(lora={"r": 4}, activation_checkpointing=["LlamaDecoderLayer"])
    points = dict(estimate.timeline)
    assert list(points) == ["after load", "forward peak", "backward peak", "optimizer step peak"]
    assert estimate.peak == max(points.values()) == points[f"{estimate.peak_phase} peak"]
    assert sum(estimate.peak_split.values()) == estimate.peak
    assert points["after load"] < points["forward peak"]
    table = estimate.table()
    assert f"PEAK {estimate.peak / 2**20:,.2f} MiB" in table and f"during the {estimate.peak_phase}" in table
    assert "this is the figure that must fit" in table


def test_accumulation_raises_the_window_peak_and_keeps_the_components():
    one = _tiny_llama_estimate()
    two = _tiny_llama_estimate(accumulate_grad_batches=2)
    assert two.peak > one.peak  # the second micro-batch runs with the first one's gradients held
    assert two.gradients == one.gradients and two.weights == one.weights


def test_cuda_allocations_are_rounded_as_the_caching_allocator_rounds():
    assert [allocated_bytes(n, "cuda") for n in (0, 1, 512, 513, 1536)] == [0, 512, 512, 1024, 1536]
    assert allocated_bytes(513, "cpu") == 513
    on_cpu = _tiny_llama_estimate(device="cpu")
    on_cuda = _tiny_llama_estimate(device="cuda")
    assert on_cuda.peak > on_cpu.peak and on_cuda.peak % 512 == 0
    assert "fragmentation" in on_cuda.table() and "fragmentation" not in on_cpu.table()


def _config_only_directory(tmp_path, layers=2):
    """A real model's config.json (SmolLM2-135M: tied embeddings, 9 heads / 3 KV heads), shrunk, and nothing else."""
    config = {**SMOLLM2_135M, "num_hidden_layers": layers, "vocab_size": 512}
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_a_causal_lm_is_estimated_from_its_config_json_alone(tmp_path):
    pytest.importorskip("bitsandbytes")
    from pl_lowprec.models import CausalLM
    from pl_lowprec.transforms.config import TransformConfig
    from pl_lowprec.transforms.pipeline import ModelTransform

    directory = _config_only_directory(tmp_path)
    batch = {"input_ids": torch.zeros(2, 64, dtype=torch.long), "labels": torch.zeros(2, 64, dtype=torch.long)}
    estimate = estimate_memory(
        functools.partial(CausalLM, pretrained=str(directory), loss_chunk_size=32),
        batch,
        quantization="nf4-dq",
        lora={"r": 8, "target_modules": "all-linear"},  # needs the model configure_model builds
        activation_checkpointing=["LlamaDecoderLayer"],
    )
    # 2 blocks x 7 projections of SmolLM2's shapes in 4-bit; the tied embedding/head is not quantized
    assert estimate.weights["quantized_4bit"] > 2 * 7 * 576 * 576 * 0.5 * 0.5
    assert estimate.peak > estimate.weights["quantized_4bit"] and estimate.peak_phase == "backward"
    from_file = estimate_memory(
        functools.partial(CausalLM, pretrained=str(directory / "config.json"), loss_chunk_size=32),
        batch,
        quantization="nf4-dq",
        lora={"r": 8, "target_modules": "all-linear"},
        activation_checkpointing=["LlamaDecoderLayer"],
    )
    assert from_file.peak == estimate.peak  # the config.json file itself, or its directory
    for source in (directory, directory / "config.json"):
        model = CausalLM(pretrained=str(source))
        with pytest.raises(FileNotFoundError, match=r"has a config.json but no weights: .*training needs the safetens"):
            ModelTransform(TransformConfig()).weights_for(model)  # what fit asks before loading


def test_the_shipped_causal_lm_config_is_estimated_from_a_config_json(tmp_path):
    """configs/finetune-causal-lm.yaml builds its model in CausalLM.configure_model, and trains 2 micro-batches
    per step: the estimate runs configure_model (lora target_modules 'all-linear' needs its linear layers) and
    covers the whole window."""
    pytest.importorskip("bitsandbytes")
    from pl_lowprec.cli.estimate import estimate_config
    from pl_lowprec.demo.tokenizer import train_tokenizer

    directory = _config_only_directory(tmp_path / "model")
    train_tokenizer(["def f(x):\n    return x + 1\n"] * 50, vocab_size=300).save_pretrained(directory)
    records = tmp_path / "train.jsonl"
    records.write_text("".join(json.dumps({"text": f"line {i} " * 40}) + "\n" for i in range(16)))
    args = ["--config", str(ROOT / "configs/finetune-causal-lm.yaml"), f"--model.pretrained={directory}"]
    args += [f"--data.tokenizer={directory}", f"--data.train_files={records}", f"--data.val_files={records}"]
    args += ["--data.seq_len=64", "--data.batch_size=2"]
    estimate = estimate_config(args)
    assert estimate.weights["quantized_4bit"] > 0 and estimate.trainable_parameters > 0
    single = estimate_config([*args, "--trainer.accumulate_grad_batches=1"])
    assert estimate.peak > single.peak  # the second micro-batch runs while the first one's gradients are held


def test_activation_offloading_gives_the_device_and_host_peaks_apart():
    kept = _tiny_llama_estimate(device="cuda")
    offloaded = _tiny_llama_estimate(device="cuda", activation_offloading=True)
    assert offloaded.peak < kept.peak  # saved activations wait in host memory during forward
    assert 0 < offloaded.host_peak <= offloaded.activations_offloaded_to_host
    assert kept.host_peak == 0
    assert f"host memory peak (offloaded activations): {offloaded.host_peak / 2**20:,.2f} MiB" in offloaded.table()


def test_a_sharded_estimate_is_per_rank():
    pytest.importorskip("torchao")
    from pl_lowprec.distributed.sharding import Sharding
    from pl_lowprec.transforms.nf4 import NF4Layout

    def per_rank(world_size):
        sharding = Sharding(units=["LlamaDecoderLayer"], layout=NF4Layout(scaler_block_size=32))
        return _tiny_llama_estimate(
            quantization="nf4", lora={"r": 4}, sharding=sharding, world_size=world_size, extrapolate=False
        )

    one = per_rank(1)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        two = per_rank(2)
    assert not [w for w in said if "FakeTensor" in str(w.message)]  # torchao's gather checks fake pointers
    assert two.world_size == 2 and "per rank of 2" in two.table()
    assert two.weights["quantized_4bit"] == pytest.approx(one.weights["quantized_4bit"] / 2, rel=0.05)
    assert two.gradients == one.gradients // 2 and two.optimizer_state < one.optimizer_state
