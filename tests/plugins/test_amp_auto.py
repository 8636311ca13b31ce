"""``AMPPrecision("auto")``: each branch of the choice (capabilities patched), what it says, what it records,
what QLoRA and the estimator do with it, and ``float32_matmul_precision``."""

import logging
from contextlib import contextmanager
from unittest import mock

import pytest
import torch
from lightning_helpers import Classifier, quiet_trainer
from plain_amp_loop import make_classification_data, make_mlp
from torch import nn

from pl_lowprec import AMPPrecision, LowPrecisionStrategy, choose_precision, estimate_memory

pytest.importorskip("bitsandbytes")


@contextmanager
def cpu_with(amx: bool = False, avx512_bf16: bool = False):
    with (
        mock.patch.object(torch.cpu, "_is_amx_tile_supported", return_value=amx),
        mock.patch.object(torch.cpu, "_is_avx512_bf16_supported", return_value=avx512_bf16),
    ):
        yield


@contextmanager
def cuda_with(bf16: bool, capability: tuple[int, int], name: str):
    with (
        mock.patch.object(torch.cuda, "is_bf16_supported", return_value=bf16),
        mock.patch.object(torch.cuda, "get_device_capability", return_value=capability),
        mock.patch.object(torch.cuda, "get_device_name", return_value=name),
    ):
        yield


@pytest.mark.parametrize(
    ("amx", "avx512_bf16", "expected", "found"),
    [
        (False, False, "32-true", "neither AMX nor avx512_bf16"),
        (False, True, "bf16-mixed", "avx512_bf16"),
        (True, False, "bf16-mixed", "AMX"),
        (True, True, "bf16-mixed", "AMX and avx512_bf16"),
    ],
)
def test_cpu_branches(amx, avx512_bf16, expected, found):
    with cpu_with(amx, avx512_bf16):
        choice = choose_precision("cpu")
    assert choice.precision == expected
    assert found in choice.reason and "torch capability" in choice.reason


@pytest.mark.parametrize(
    ("bf16", "capability", "name", "expected"),
    [(True, (8, 0), "NVIDIA A100", "bf16-mixed"), (False, (7, 5), "Tesla T4", "16-mixed")],
)
def test_cuda_branches(bf16, capability, name, expected):
    with cuda_with(bf16, capability, name):
        choice = choose_precision("cuda:0")
        plugin = AMPPrecision("auto", init_scale=1024.0)
        with pytest.warns(UserWarning) if not torch.cuda.is_available() and not bf16 else _nothing():
            plugin.resolve(torch.device("cuda:0"))  # GradScaler("cuda") warns without a GPU
    assert choice.precision == expected == plugin.precision
    assert name in choice.device and f"{capability[0]}.{capability[1]}" in choice.reason
    if expected == "16-mixed":
        assert plugin.loss_scale_mode == "dynamic" and plugin.scaler is not None
        assert plugin.compute_dtype == torch.float16
    else:
        assert plugin.scaler is None and plugin.compute_dtype == torch.bfloat16


@contextmanager
def _nothing():
    yield


def test_unknown_device_type_names_the_fix():
    with pytest.raises(ValueError, match=r"'mps'.*Pass precision='16-mixed' or 'bf16-mixed'"):
        choose_precision("mps")


class DtypeRecorder(Classifier):
    """Records the dtype the model computes in during training."""

    def training_step(self, batch, batch_idx):
        x, _ = batch
        self.seen_dtype = self(x).dtype
        return super().training_step(batch, batch_idx)


def _fit(plugin, steps=2, ckpt_path=None, **trainer_kwargs):
    module = DtypeRecorder(make_mlp())
    loader = torch.utils.data.DataLoader(make_classification_data(n=steps * 8), batch_size=8)
    trainer = quiet_trainer(plugins=[plugin], max_steps=steps, **trainer_kwargs)
    trainer.fit(module, loader, ckpt_path=ckpt_path)
    return trainer, module


@pytest.mark.parametrize(
    ("native", "precision", "dtype"), [(False, "32-true", torch.float32), (True, "bf16-mixed", torch.bfloat16)]
)
def test_trainer_reports_and_uses_the_choice_and_says_why_once(native, precision, dtype, caplog):
    plugin = AMPPrecision("auto")
    assert plugin.precision == "auto"  # nothing is chosen before the device is known
    with pytest.raises(RuntimeError, match="has not chosen"):
        _ = plugin.compute_dtype
    with cpu_with(avx512_bf16=native), caplog.at_level(logging.INFO):
        trainer, module = _fit(plugin, strategy=LowPrecisionStrategy())  # resolves in the transform and setup
    assert trainer.precision == precision and plugin.compute_dtype == dtype
    assert module.seen_dtype == dtype  # fp32 means no autocast at all
    said = [r.getMessage() for r in caplog.records if "AMPPrecision('auto') chose" in r.getMessage()]
    assert len(said) == 1 and f"'{precision}'" in said[0] and "on cpu" in said[0]
    assert ("neither AMX nor avx512_bf16" in said[0]) is not native


def test_loss_scale_settings_unused_by_the_choice_are_named(caplog):
    with cpu_with(), caplog.at_level(logging.INFO):
        _fit(AMPPrecision("auto", init_scale=1024.0, growth_interval=10))
    said = " ".join(r.getMessage() for r in caplog.records)
    assert "init_scale=1024.0, growth_interval=10" in said and "apply only when it chooses '16-mixed'" in said


def test_bad_loss_scale_settings_fail_before_the_trainer_even_under_auto():
    with pytest.raises(ValueError, match=r"growth_factor=0.5 must be > 1.0"):
        AMPPrecision("auto", growth_factor=0.5)


def test_checkpoint_records_the_choice_and_resume_elsewhere_says_so(tmp_path):
    with cpu_with():
        trainer, _ = _fit(AMPPrecision("auto"), default_root_dir=tmp_path, enable_checkpointing=True)
    ckpt_path = tmp_path / "auto.ckpt"
    trainer.save_checkpoint(ckpt_path)
    recorded = torch.load(ckpt_path, weights_only=False)["AMPPrecision"]
    assert recorded["precision"] == "32-true" and recorded["requested_precision"] == "auto"

    # Same machine: resumes silently with the same choice.
    with cpu_with(), _no_warning_matching("trained with precision"):
        trainer, _ = _fit(AMPPrecision("auto"), steps=3, ckpt_path=ckpt_path)
    assert trainer.precision == "32-true" and trainer.global_step == 3

    # A machine with native bf16: it continues in bf16 and says what changed and how to keep the old choice.
    with cpu_with(amx=True), pytest.warns(UserWarning, match=r"'32-true'; this run uses 'bf16-mixed'.*AMX"):
        trainer, _ = _fit(AMPPrecision("auto"), steps=3, ckpt_path=ckpt_path)
    assert trainer.precision == "bf16-mixed"


@contextmanager
def _no_warning_matching(text: str):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    assert not [w for w in caught if text in str(w.message)]


@pytest.mark.parametrize(("native", "dtype"), [(False, torch.float32), (True, torch.bfloat16)])
def test_qlora_compute_dtype_follows_the_choice(native, dtype):
    import bitsandbytes as bnb

    module = DtypeRecorder(nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 4)))
    loader = torch.utils.data.DataLoader(make_classification_data(n=8), batch_size=8)
    strategy = LowPrecisionStrategy(quantization="nf4", lora={"r": 4, "target_modules": ["0", "2"]})
    with cpu_with(avx512_bf16=native):
        quiet_trainer(plugins=[AMPPrecision("auto")], strategy=strategy, max_steps=1).fit(module, loader)
    quantized = [m for m in module.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert quantized and all(m.compute_dtype == dtype for m in quantized)


def test_estimator_takes_auto_for_the_target_device():
    def build():
        return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))

    batch = torch.zeros(8, 64)
    with cpu_with():
        auto = estimate_memory(build, batch, precision="auto", device="cpu")
    with cpu_with(avx512_bf16=True):
        auto_bf16 = estimate_memory(build, batch, precision="auto", device="cpu")
    assert auto.total == estimate_memory(build, batch, precision="32-true").total
    assert auto_bf16.total == estimate_memory(build, batch, precision="bf16-mixed").total
    assert auto.total != auto_bf16.total


def test_matmul_precision_is_applied_during_the_run_and_restored(monkeypatch):
    torch.set_float32_matmul_precision("highest")
    seen = []

    class Probe(DtypeRecorder):
        def on_train_start(self):
            seen.append(torch.get_float32_matmul_precision())

    plugin = AMPPrecision("bf16-mixed", float32_matmul_precision="medium")
    loader = torch.utils.data.DataLoader(make_classification_data(n=8), batch_size=8)
    quiet_trainer(plugins=[plugin], max_steps=1).fit(Probe(make_mlp()), loader)
    assert seen == ["medium"]
    assert torch.get_float32_matmul_precision() == "highest"


def test_matmul_precision_rejects_unknown_values():
    with pytest.raises(ValueError, match=r"float32_matmul_precision='low'.*'highest'.*'high'.*'medium'"):
        AMPPrecision("bf16-mixed", float32_matmul_precision="low")
