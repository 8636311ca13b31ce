"""Every file in configs/ runs as shipped through the CLI (2 steps on CPU) with what it configures in effect."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from pl_lowprec import choose_precision
from pl_lowprec.cli import build_cli
from pl_lowprec.transforms.checkpointing import is_checkpointed
from pl_lowprec.transforms.lora import ADAPTER_NAME, lora_layers
from pl_lowprec.transforms.qat import is_converted
from pl_lowprec.transforms.quantization import is_quantized

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
# fp8 needs an FP8 GPU (tests/transforms/test_fp8.py runs it emulated); finetune-causal-lm needs the demo model that
# tests/demo/test_demo_model.py writes and runs it on; ddp and fsdp-qlora run on 2 processes below.
MULTI_PROCESS_OR_ELSEWHERE = ("ddp.yaml", "fsdp-qlora.yaml", "fp8.yaml", "finetune-causal-lm.yaml")
SINGLE_PROCESS = [c for c in CONFIGS if c.name not in MULTI_PROCESS_OR_ELSEWHERE]


def _short(class_path: str) -> str:
    return class_path.rpartition(".")[2]


def _fast_args(config: Path) -> list[str]:
    return [
        "--config",
        str(config),
        "--trainer.max_steps",
        "2",
        "--trainer.limit_val_batches",
        "1",
        "--trainer.num_sanity_val_steps",
        "1",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.accelerator",
        "cpu",
    ]


def test_every_config_starts_with_its_command_and_is_covered():
    assert {c.name for c in CONFIGS} >= {
        "quickstart.yaml",
        "amp-fp16.yaml",
        "amp-bf16.yaml",
        "qlora-nf4-bf16.yaml",
        "qlora-fp16-t4.yaml",
        "checkpointing.yaml",
        "accumulation.yaml",
        "lora-8bit-optimizer.yaml",
        "ddp.yaml",
        "fsdp-qlora.yaml",
    }
    listed = (Path(__file__).resolve().parents[1] / "docs/cli-and-configs.md").read_text()
    for config in CONFIGS:
        assert config.read_text().splitlines()[0] == f"# Run: pl-lowprec fit --config configs/{config.name}"
        assert f"| `{config.name}` |" in listed, f"docs/cli-and-configs.md's table of configs lacks {config.name}"


# What each strategy setting must have done, as the bitsandbytes class a user would see on this device.
BITSANDBYTES_OPTIMIZERS = {"adamw8bit": "AdamW8bit", "paged_adamw8bit": "PagedAdamW8bit", "lion8bit": "Lion8bit"}


def _quantization_mode(setting) -> str:
    return setting if isinstance(setting, str) else setting["init_args"]["mode"]


def assert_strategy_in_effect(settings: dict, model: torch.nn.Module, optimizer, device: torch.device) -> None:
    """Each setting of the config's strategy shows on the trained model or optimizer, not only on the strategy."""
    if settings.get("quantization") is not None:
        mode = _quantization_mode(settings["quantization"])
        quantized = {n: m for n, m in model.named_modules() if is_quantized(m)}
        assert quantized, f"quantization={mode!r} left no bitsandbytes layer"
        # the output head stays unquantized (under a LoRA wrapper its layer is lm_head.base_layer)
        assert not any("lm_head" in n for n in quantized), (
            f"the head was quantized: {[n for n in quantized if 'lm_head' in n]}"
        )
        if mode != "int8":
            quant_type, _, dq = mode.partition("-")
            for layer in quantized.values():
                assert layer.weight.quant_type == quant_type and layer.weight.compress_statistics == bool(dq)
    if settings.get("lora") is not None:
        adapted = lora_layers(model)
        assert adapted, "lora= injected no LoRA layer"
        assert {layer.r[ADAPTER_NAME] for layer in adapted.values()} == {settings["lora"]["r"]}
        targets = settings["lora"].get("target_modules", "all-linear")
        if isinstance(targets, list):
            assert {n.rpartition(".")[2] for n in adapted} == set(targets)
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        assert trainable and all("lora_" in n for n in trainable)
        assert not any("lm_head" in n for n in adapted), "LoRA adapted the output head, which skip_modules keeps out"
    if settings.get("optimizer") is not None:
        name = settings["optimizer"]
        expected = BITSANDBYTES_OPTIMIZERS[name]
        if device.type != "cuda":
            expected = expected.removeprefix("Paged")  # paged optimizers need CUDA; the swap says so
        assert type(optimizer).__module__.startswith("bitsandbytes.optim")
        assert type(optimizer).__name__ == expected
    if settings.get("activation_checkpointing") is not None:
        names = settings["activation_checkpointing"]
        blocks = [m for m in model.modules() if type(m).__name__ in names]
        every_n = settings.get("checkpoint_every_n", 1)
        assert blocks and [is_checkpointed(b) for b in blocks] == [i % every_n == 0 for i in range(len(blocks))]
    if settings.get("qat") is not None:
        head = model.get_submodule("model.lm_head")  # neither fake-quantized nor converted to int4
        assert type(head) is torch.nn.Linear and type(head.weight.data) is torch.Tensor, (
            f"qat= changed the head: {head}"
        )
        convert = settings["qat"].get("init_args", {}).get("convert_on_fit_end", True)
        assert is_converted(model) == convert, "qat= did not leave the model in the form the config asks for"


@pytest.mark.parametrize("config", SINGLE_PROCESS, ids=lambda c: c.stem)
def test_config_runs_two_steps_with_its_components(config, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = yaml.safe_load(config.read_text())["trainer"]
    cli = build_cli(["fit", *_fast_args(config)])
    trainer = cli.trainer
    assert trainer.global_step == 2 and trainer.state.finished
    for plugin in spec.get("plugins", []):
        assert type(trainer.precision_plugin).__name__ == _short(plugin["class_path"])
        asked = plugin["init_args"]["precision"]
        assert trainer.precision_plugin.requested_precision == asked
        expected = choose_precision(trainer.strategy.root_device).precision if asked == "auto" else asked
        assert trainer.precision == expected
    if "strategy" in spec:
        assert type(trainer.strategy).__name__ == _short(spec["strategy"]["class_path"])
        settings = spec["strategy"].get("init_args", {})
        if settings.get("activation_checkpointing") == "auto":  # chosen for this machine before loading
            chosen = trainer.strategy.transform_config
            assert chosen.activation_checkpointing != "auto" and chosen.memory_saving != "auto"
            settings = {**settings, "activation_checkpointing": chosen.activation_checkpointing}
            settings["checkpoint_every_n"] = chosen.checkpoint_every_n
        assert_strategy_in_effect(settings, cli.model, trainer.optimizers[0], trainer.strategy.root_device)
    in_effect = {type(c).__name__ for c in trainer.callbacks}
    assert {_short(c["class_path"]) for c in spec.get("callbacks", [])} <= in_effect
    if "accumulate_grad_batches" in spec:
        assert trainer.accumulate_grad_batches == spec["accumulate_grad_batches"]


def test_short_class_names_and_the_other_subcommands(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "short.yaml"
    config.write_text(
        """
trainer:
  accelerator: cpu
  max_steps: 1
  limit_val_batches: 1
  limit_test_batches: 1
  limit_predict_batches: 1
  enable_progress_bar: false
  plugins: [{class_path: AMPPrecision, init_args: {precision: bf16-mixed}}]
  strategy: {class_path: LowPrecisionStrategy, init_args: {activation_checkpointing: [Block]}}
  callbacks: [{class_path: LossScaleMonitor}, {class_path: MemoryTracker, init_args: {print_summary: false}}]
model: {class_path: TinyGPT, init_args: {dim: 32, layers: 1}}
data: {class_path: StdlibTextDataModule, init_args: {seq_len: 32, max_bytes: 20000}}
"""
    )
    for subcommand in ("fit", "validate", "test", "predict"):
        cli = build_cli([subcommand, "--config", str(config)])
        assert type(cli.trainer.strategy).__name__ == "LowPrecisionStrategy"
        tracker = next(c for c in cli.trainer.callbacks if type(c).__name__ == "MemoryTracker")
        assert subcommand in tracker.summary
    assert (tmp_path / "runs").is_dir() and not (tmp_path / "config.yaml").exists()


@pytest.mark.slow
def test_ddp_config_runs_on_two_cpu_processes(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "pl_lowprec", "fit", *_fast_args(ROOT / "configs/ddp.yaml")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Memory, fit (cpu, 2 ranks, max across ranks)" in result.stdout
    assert "params_quantized_4bit" in result.stdout
    assert len(list(tmp_path.rglob("last.ckpt"))) == 1  # the final step, for --ckpt_path last and export


@pytest.mark.slow
def test_fsdp_config_runs_on_two_cpu_processes(tmp_path):
    pytest.importorskip("torchao")
    result = subprocess.run(
        [sys.executable, "-m", "pl_lowprec", "fit", *_fast_args(ROOT / "configs/fsdp-qlora.yaml")],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "FSDP2: 2 shard units and the root across 2 ranks." in result.stdout + result.stderr
    assert "Memory, fit (cpu, 2 ranks, max across ranks)" in result.stdout
    assert len(list(tmp_path.rglob("last.ckpt"))) == 1  # the final step, for --ckpt_path last and export
