"""fp8=: torchao float8 linear layers in place and training (CPU through torchao's emulation); refused before
training on a device without FP8; real FP8 on a capable GPU (CUDA-marked)."""

import re

import lightning.pytorch as pl
import pytest
import torch
from lightning_helpers import quiet_trainer

from pl_lowprec import AMPPrecision, LowPrecisionStrategy
from pl_lowprec.demo.tiny_gpt import TinyGPT
from pl_lowprec.transforms.fp8 import FP8Config, check_fp8_device, is_fp8

pytest.importorskip("torchao")


def _gpt():
    torch.manual_seed(0)
    return TinyGPT(dim=64, layers=2, heads=2, max_len=64, warmup_steps=1)


def _repeated_batch(times=12):
    ids = torch.randint(0, 256, (4, 33), generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader([{"input_ids": r} for r in ids] * times, batch_size=4)


class Losses(pl.Callback):
    def __init__(self):
        self.losses = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(outputs["loss"].item())


def _fit(fp8, steps=12, plugins=()):
    model, losses = _gpt(), Losses()
    trainer = quiet_trainer(
        strategy=LowPrecisionStrategy(fp8=fp8), plugins=list(plugins), max_steps=steps, callbacks=[losses]
    )
    trainer.fit(model, _repeated_batch(steps))
    return model, losses.losses


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise", "rowwise_with_gw_hp"])
def test_emulated_float8_layers_are_in_place_and_the_loss_falls(recipe):
    model, losses = _fit(FP8Config(recipe, emulate=True))
    swapped = [n for n, m in model.named_modules() if is_fp8(m)]
    assert swapped == [f"blocks.{i}.mlp.{j}" for i in range(2) for j in (0, 2)]  # not MHA's out_proj, not the head
    assert model.blocks[0].mlp[0].config.emulate
    assert losses[-1] < 0.8 * losses[0]


def test_emulated_float8_differs_from_plain_training():
    """The float8 rounding is really applied: the first loss differs from the high-precision one."""
    _, plain = _fit(None, steps=1)
    _, fp8 = _fit(FP8Config(emulate=True), steps=1)
    assert fp8[0] != plain[0]
    assert abs(fp8[0] - plain[0]) < 0.05 * plain[0]


def test_fp8_on_cpu_is_refused_before_training_with_what_is_needed():
    model = _gpt()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = quiet_trainer(strategy=LowPrecisionStrategy(fp8="tensorwise"), max_steps=1)
    with pytest.raises(RuntimeError, match=r"compute capability 8.9 or higher .* this Trainer runs on cpu"):
        trainer.fit(model, _repeated_batch(1))
    assert not any(is_fp8(m) for m in model.modules())
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_fp8_on_a_gpu_without_fp8_names_the_gpu_and_its_capability(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA A100-SXM4-80GB")
    with pytest.raises(RuntimeError, match=r"found NVIDIA A100-SXM4-80GB with compute capability 8.0"):
        check_fp8_device(torch.device("cuda", 0), FP8Config())
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_fp8_device(torch.device("cuda", 0), FP8Config())  # Hopper passes


def test_unknown_recipe_and_impossible_combinations_are_refused():
    with pytest.raises(ValueError, match=r"fp8 recipe 'blockwise' is not supported. Allowed: 'tensorwise'"):
        LowPrecisionStrategy(fp8="blockwise")
    with pytest.raises(ValueError, match=r"qat= and fp8= cannot be combined: both replace the same nn.Linear"):
        LowPrecisionStrategy(qat="int4-weight-only", fp8="tensorwise")
    with pytest.raises(ValueError, match=r"quantization= and fp8= cannot be combined"):
        LowPrecisionStrategy(quantization="nf4", fp8="tensorwise")


def test_layers_whose_dimensions_the_float8_matmul_cannot_take_are_named():
    torch.manual_seed(0)
    model = TinyGPT(dim=40, layers=1, heads=2, max_len=64)
    trainer = quiet_trainer(strategy=LowPrecisionStrategy(fp8=FP8Config(emulate=True)), max_steps=1)
    with pytest.raises(ValueError, match=r"multiples of 16; these are not: blocks.0.mlp.0 \(160, 40\)"):
        trainer.fit(model, _repeated_batch(1))


@pytest.mark.cuda
def test_real_float8_trains_on_an_fp8_gpu():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs compute capability 8.9+")
    model, losses = _gpt(), Losses()
    trainer = quiet_trainer(
        accelerator="cuda",
        strategy=LowPrecisionStrategy(fp8="rowwise"),
        plugins=[AMPPrecision("bf16-mixed")],
        max_steps=12,
        callbacks=[losses],
    )
    trainer.fit(model, _repeated_batch(12))
    assert is_fp8(model.blocks[0].mlp[0]) and not model.blocks[0].mlp[0].config.emulate
    assert losses.losses[-1] < 0.8 * losses.losses[0]


def test_fp8_base_layers_under_lora_adapters():
    model, losses = _gpt(), Losses()
    strategy = LowPrecisionStrategy(fp8=FP8Config(emulate=True), lora={"r": 4, "lora_alpha": 8})
    quiet_trainer(strategy=strategy, max_steps=12, callbacks=[losses]).fit(model, _repeated_batch(12))
    layer = model.blocks[0].mlp[0]
    assert is_fp8(layer.base_layer) and not layer.base_layer.weight.requires_grad
    assert type(layer.lora_A["default"]) is torch.nn.Linear  # adapters stay in high precision
    assert losses.losses[-1] < losses.losses[0]


def test_fp8_config_refuses_cpu_and_runs_emulated(tmp_path, monkeypatch, capsys):
    from test_configs import ROOT, _fast_args

    from pl_lowprec.cli import build_cli

    monkeypatch.chdir(tmp_path)
    fast = _fast_args(ROOT / "configs/fp8.yaml")
    at = fast.index("--trainer.accelerator")
    args = ["fit", *fast[:at], *fast[at + 2 :]]  # the config's own accelerator, as its header's command runs it
    with pytest.raises(SystemExit) as refused:  # one paragraph, exit status 2, before the first step
        build_cli(args)
    assert refused.value.code == 2
    assert re.search(r"needs a CUDA GPU with compute capability 8.9 .* runs on cpu", capsys.readouterr().err)
    cli = build_cli([*args, "--trainer.strategy.init_args.fp8.init_args.emulate", "true"])
    assert cli.trainer.global_step == 2
    assert is_fp8(cli.model.model.model.layers[0].mlp.gate_proj)


def test_estimate_runs_the_float8_layers_and_matches_the_measured_bytes(tmp_path, monkeypatch):
    from pl_lowprec import MemoryTracker, estimate_memory

    monkeypatch.chdir(tmp_path)  # MemoryTracker writes its summary into the working directory
    tracker = MemoryTracker(print_summary=False)
    strategy = LowPrecisionStrategy(fp8=FP8Config(emulate=True))
    quiet_trainer(strategy=strategy, max_steps=1, callbacks=[tracker]).fit(_gpt(), _repeated_batch(1))
    batch = next(iter(_repeated_batch(1)))
    estimate = estimate_memory(_gpt, batch, fp8="tensorwise")  # emulated inside, whatever the config says
    assert estimate.activations == tracker.summary["fit"]["bytes"]["activations"]


def test_a_device_that_cannot_run_fp8_is_refused_before_the_memory_search(caplog):
    """The memory search of 'auto' settings simulated a step and said its choice before the device was refused."""
    import logging

    from pl_lowprec._checks import CannotRunHere

    trainer = quiet_trainer(strategy=LowPrecisionStrategy(fp8="rowwise", memory_saving="auto"), max_steps=1)
    with (
        caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"),
        pytest.raises(CannotRunHere, match=r"fp8='rowwise' needs a CUDA GPU .* this Trainer runs on cpu"),
    ):
        trainer.fit(_gpt(), _repeated_batch(1))
    assert not [r for r in caplog.records if r.getMessage().startswith("Memory settings")]
