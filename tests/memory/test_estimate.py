"""estimate_memory: exact weights, gradients and optimizer state; activations near the measured; no allocation."""

import functools
import resource
from pathlib import Path

import pytest
import torch
from lightning_helpers import quiet_trainer
from qlora_helpers import ids_loader

from pl_lowprec import AMPPrecision, FP8Config, LowPrecisionStrategy, MemoryTracker, estimate_memory
from pl_lowprec.cli.dispatch import main as cli
from pl_lowprec.cli.estimate import estimate_config
from pl_lowprec.demo import StdlibTextDataModule, TinyGPT, TinyLlama

ROOT = Path(__file__).resolve().parents[2]


def _measure(build, precision, **strategy):
    tracker = MemoryTracker(print_summary=False)
    plugins = [AMPPrecision(precision)] if precision.endswith("-mixed") else []
    kwargs = {} if plugins else {"precision": precision}
    trainer = quiet_trainer(
        strategy=LowPrecisionStrategy(**strategy), plugins=plugins, max_steps=1, callbacks=[tracker], **kwargs
    )
    torch.manual_seed(0)
    trainer.fit(build(), ids_loader(batches=1, batch_size=8, seq_len=65))
    return tracker.summary["fit"]["bytes"]


CASES = {
    "gpt fp32": (functools.partial(TinyGPT, dim=64, layers=2), "32-true", {}),
    "gpt bf16 checkpointed": (
        functools.partial(TinyGPT, dim=64, layers=4),
        "bf16-mixed",
        {"activation_checkpointing": ["Block"], "checkpoint_every_n": 2},
    ),
    "llama qlora adamw8bit": (
        functools.partial(TinyLlama, hidden_size=128),
        "bf16-mixed",
        {"quantization": "nf4-dq", "lora": {"r": 32, "lora_alpha": 64}, "optimizer": "adamw8bit"},
    ),
    "llama int8 fp16": (
        functools.partial(TinyLlama, hidden_size=64, intermediate_size=192),
        "16-mixed",
        {"quantization": "int8", "lora": {"r": 8}, "activation_checkpointing": ["LlamaDecoderLayer"]},
    ),
    "llama lora torchao_adamw8bit": (  # its real step crashed on fake tensors: the estimate simulates its state
        functools.partial(TinyLlama, hidden_size=128),
        "bf16-mixed",
        {"lora": {"r": 32, "lora_alpha": 64}, "optimizer": "torchao_adamw8bit"},
    ),
    "llama qlora dora": (  # DoRA dequantizes the 4-bit weight itself; its lora_B(lora_A(eye)) graph dies at once
        functools.partial(TinyLlama, hidden_size=64, intermediate_size=192),
        "bf16-mixed",
        {"quantization": "nf4", "lora": {"r": 8, "use_dora": True}},
    ),
    "llama lora bf16-true": (
        functools.partial(TinyLlama, hidden_size=64, intermediate_size=192),
        "bf16-true",
        {"lora": {"r": 8}},
    ),
}


@pytest.mark.parametrize("case", CASES, ids=str)
def test_estimate_matches_the_measured_breakdown(case):
    pytest.importorskip("bitsandbytes")
    build, precision, strategy = CASES[case]
    batch = {"input_ids": torch.zeros(8, 65, dtype=torch.long)}
    estimate = estimate_memory(build, batch, precision=precision, **{"optimizer": "adamw", **strategy}).as_dict()
    measured = _measure(build, precision, **strategy)
    for key in [k for k in measured if k.startswith("params_")] + ["gradients", "optimizer_state"]:
        assert estimate[key] == measured[key], key  # exact counts
    assert abs(estimate["activations"] - measured["activations"]) <= 0.25 * measured["activations"]


def test_a_billion_parameter_model_is_estimated_without_allocating_it():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    build = functools.partial(
        TinyLlama, hidden_size=2048, intermediate_size=5632, num_layers=22, num_heads=16, max_len=2048
    )
    estimate = estimate_memory(
        build,
        {"input_ids": torch.zeros(1, 256, dtype=torch.long)},
        precision="bf16-mixed",
        quantization="nf4-dq",
        lora={"r": 16, "lora_alpha": 32},
        activation_checkpointing=["LlamaDecoderLayer"],
    )
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert estimate.parameters >= 1_000_000_000
    assert estimate.weights["quantized_4bit"] > 0.5 * 1e9 * 0.5  # ~0.52 bytes for each of ~1B quantized weights
    assert grown_mib < 300, f"peak RSS grew by {grown_mib:.0f} MiB"  # 1B fp32 weights would be 4000 MiB
    assert estimate.extrapolated  # its forward overtakes the backward past 4 blocks: on its own line (depth.py)


def test_cli_prints_the_table(capsys):
    cli(["estimate", "--config", str(ROOT / "configs/quickstart.yaml")])  # `python -m pl_lowprec`: test_quickstart
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "Batch: 8 rows x 128 positions, the longest batch the training data makes."
    assert lines[1].startswith("Estimated training memory (")
    for component in ("params_quantized_4bit", "gradients", "optimizer_state", "activations", "total"):
        assert any(line.split()[:1] == [component] for line in lines), component
    at_peak = lines[
        lines.index("  At the peak:") + 1 : lines.index(
            "  Components (what the memory is for; their total is not the peak):"
        )
    ]
    mib = [float(line.split()[-2]) for line in at_peak]
    assert len(mib) > 2 and mib == sorted(mib, reverse=True)  # the largest first, the same order every run


CONFIGS_BY_HAND = {  # a shipped config, and estimate_memory called by hand with what it says
    "fp8 (accelerator: cuda)": (
        ["configs/fp8.yaml", "--trainer.accelerator=cuda"],
        "torchao",
        functools.partial(TinyLlama, hidden_size=256, intermediate_size=704, num_layers=4, num_heads=8, lr=0.002),
        {
            "precision": "bf16-mixed",
            "fp8": FP8Config(recipe="rowwise", skip_modules=["lm_head"], emulate=False),
            "activation_checkpointing": ["LlamaDecoderLayer"],
        },
    ),
    "qlora fp16 T4": (
        ["configs/qlora-fp16-t4.yaml", "--trainer.accelerator=cuda"],
        "bitsandbytes",
        functools.partial(TinyLlama, hidden_size=128, num_layers=2),
        {
            "precision": "16-mixed",
            "quantization": "nf4",
            "lora": {"r": 16, "lora_alpha": 32},
            "optimizer": "paged_adamw8bit",
            "activation_checkpointing": ["LlamaDecoderLayer"],
        },
    ),
}


@pytest.mark.parametrize("case", CONFIGS_BY_HAND, ids=str)
def test_a_cuda_config_is_estimated_here_with_what_it_says(case):
    """The estimate reads a config with fit's parser but builds no Trainer, so accelerator: cuda runs here."""
    (config, *overrides), needs, build, settings = CONFIGS_BY_HAND[case]
    pytest.importorskip(needs)
    estimate = estimate_config(["--config", str(ROOT / config), *overrides])
    data = StdlibTextDataModule(seq_len=128, batch_size=8)
    data.setup("fit")
    by_hand = estimate_memory(build, next(iter(data.train_dataloader())), device="cuda", **settings)
    assert estimate.as_dict() == by_hand.as_dict()
    assert estimate.parameters == by_hand.parameters > 0


def test_torchao_adamw8bit_state_bytes_are_what_the_optimizer_holds():
    pytest.importorskip("torchao")
    from torchao.optim import AdamW8bit

    from pl_lowprec.memory.bnb_standin import FakeOptimizer8bit
    from pl_lowprec.memory.breakdown import optimizer_state_bytes

    params = [torch.nn.Parameter(torch.randn(64, 128)), torch.nn.Parameter(torch.randn(8, 64))]  # 8-bit, fp32 state
    optimizer = AdamW8bit(params)
    standin = FakeOptimizer8bit(params, states=2, torchao=True)  # what the simulated step holds
    sum(p.sum() for p in params).backward()
    optimizer.step()
    standin.step()

    def nbytes(tensor):
        if hasattr(tensor, "__tensor_flatten__"):
            names, _ = tensor.__tensor_flatten__()
            return sum(nbytes(getattr(tensor, name)) for name in names)
        return tensor.numel() * tensor.element_size()

    held = sum(nbytes(t) for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t))
    assert optimizer_state_bytes([standin]) == held
