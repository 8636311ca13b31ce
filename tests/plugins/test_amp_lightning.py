"""AMPPrecision with the rest of Lightning: real fp16 on CPU, manual optimization, LightningCLI YAML."""

import copy
import logging

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.cli import LightningCLI
from lightning_helpers import Classifier, quiet_trainer
from plain_amp_loop import make_classification_data, make_mlp, train_plain_loop
from torch.nn import functional as F

from pl_lowprec import AMPPrecision, choose_precision


def _loader(n=64):
    return torch.utils.data.DataLoader(make_classification_data(n=n), batch_size=8)


class DtypeProbe(Classifier):
    def training_step(self, batch, batch_idx):
        self.seen_dtype = self(batch[0]).dtype
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize(("precision", "dtype"), [("16-mixed", torch.float16), ("bf16-mixed", torch.bfloat16)])
def test_cpu_autocast_uses_the_requested_dtype(precision, dtype):
    module = DtypeProbe(make_mlp())
    trainer = quiet_trainer(plugins=[AMPPrecision(precision)], max_steps=1)
    trainer.fit(module, _loader())
    assert module.seen_dtype == dtype  # no silent switch from fp16 to bf16 on CPU
    assert trainer.precision == precision
    assert trainer.precision_plugin.compute_dtype == dtype
    assert trainer.precision_plugin.device == "cpu"


def test_fp16_on_cpu_says_once_that_it_is_slow_and_what_is_fast(caplog, monkeypatch):
    caplog.set_level(logging.INFO)
    plugin = AMPPrecision("16-mixed")
    plugin.resolve("cpu")
    plugin.resolve("cpu")  # every fit resolves again: said once
    (note,) = [r.getMessage() for r in caplog.records if "runs real fp16 autocast" in r.getMessage()]
    auto = choose_precision("cpu").precision
    assert f"pass precision='auto', which chooses {auto!r} on this CPU" in note
    assert "bf16-mixed" in note and "docs/precision.md" in note

    caplog.clear()
    AMPPrecision("bf16-mixed").resolve("cpu")
    AMPPrecision("auto").resolve("cpu")  # never chooses fp16 on a CPU
    monkeypatch.setattr(torch.cpu, "_is_amx_fp16_supported", lambda: True, raising=False)
    AMPPrecision("16-mixed").resolve("cpu")  # AMX-FP16 computes fp16 natively
    assert "runs real fp16 autocast" not in caplog.text


class ManualClipping(pl.LightningModule):
    def __init__(self, model):
        super().__init__()
        self.model = model
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        x, y = batch
        loss = F.cross_entropy(self.model(x), y)
        self.manual_backward(loss)
        self.clip_gradients(opt, gradient_clip_val=0.05, gradient_clip_algorithm="norm")  # unscaled first
        opt.step()
        opt.zero_grad()

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def test_manual_optimization_clips_unscaled_gradients():
    reference = make_mlp()
    model = copy.deepcopy(reference)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    train_plain_loop(reference, _loader(), opt, precision="16-mixed", accumulate=1, clip=0.05)

    plugin = AMPPrecision("16-mixed")
    quiet_trainer(plugins=[plugin], max_epochs=1).fit(ManualClipping(model), _loader())
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert plugin._tracker.optimizer_steps == 8


class CLIModule(Classifier):
    def __init__(self, hidden: int = 16) -> None:
        super().__init__(make_mlp(hidden=hidden))

    def train_dataloader(self):
        return _loader()


def test_every_argument_is_settable_from_yaml(tmp_path):
    config = tmp_path / "amp.yaml"
    config.write_text(
        """
trainer:
  accelerator: cpu
  max_steps: 2
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  plugins:
    - class_path: pl_lowprec.AMPPrecision
      init_args:
        precision: 16-mixed
        loss_scale: dynamic
        init_scale: 1024.0
        growth_factor: 4.0
        backoff_factor: 0.25
        growth_interval: 50
        min_scale: 0.5
        skip_scheduler_on_overflow: false
        upcast_trainable: true
        device: cpu
"""
    )
    cli = LightningCLI(CLIModule, args=["fit", "--config", str(config)], save_config_callback=None)
    plugin = cli.trainer.precision_plugin
    assert isinstance(plugin, AMPPrecision)
    assert plugin.loss_scale_state().scale == 1024.0
    assert plugin.scaler.get_growth_factor() == 4.0 and plugin.scaler.get_backoff_factor() == 0.25
    assert plugin.scaler.get_growth_interval() == 50
    assert plugin.min_scale == 0.5 and plugin.upcast_trainable and not plugin.skip_scheduler_on_overflow
    assert cli.trainer.global_step == 2


def test_static_loss_scale_from_yaml(tmp_path):
    config = tmp_path / "static.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  max_steps: 1\n  logger: false\n  enable_checkpointing: false\n"
        "  plugins:\n    - class_path: pl_lowprec.AMPPrecision\n"
        "      init_args: {precision: 16-mixed, loss_scale: 256.0}\n"
    )
    cli = LightningCLI(CLIModule, args=["fit", "--config", str(config)], save_config_callback=None)
    assert cli.trainer.precision_plugin.loss_scale_mode == "static"
    assert cli.trainer.precision_plugin.loss_scale_state().scale == 256.0
