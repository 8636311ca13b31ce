"""Adapter-only checkpoints keep a module's buffers: running statistics that trained are not reset on resume."""

import lightning.pytorch as pl
import pytest
import torch
from lightning_helpers import HIDDEN_LORA, classification_loader, quiet_trainer
from torch import nn
from torch.nn import functional as F

from pl_lowprec import LowPrecisionStrategy
from pl_lowprec.adapters import adapter_checkpoint_state_dict, persistent_buffer_names

pytest.importorskip("peft")


class WithRunningStats(pl.LightningModule):
    """A user's module whose state is partly buffers: a BatchNorm's running statistics and a loss EMA."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(8, 8)
        self.norm = nn.BatchNorm1d(8)
        self.out = nn.Linear(8, 2)
        self.register_buffer("loss_ema", torch.zeros(()))
        self.register_buffer("scratch", torch.zeros(3), persistent=False)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.out(self.norm(self.hidden(x))), y)
        self.loss_ema.mul_(0.9).add_(0.1 * loss.detach())
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def _fit(epochs, ckpt_path=None):
    torch.manual_seed(0)
    module = WithRunningStats()
    trainer = quiet_trainer(strategy=LowPrecisionStrategy(lora=HIDDEN_LORA), max_epochs=epochs)
    trainer.fit(module, classification_loader(), ckpt_path=ckpt_path)
    return trainer, module


def test_persistent_buffer_names_leave_out_the_non_persistent_ones():
    assert persistent_buffer_names(WithRunningStats()) == {
        "loss_ema",
        "norm.running_mean",
        "norm.running_var",
        "norm.num_batches_tracked",
    }


def test_resuming_an_adapter_only_checkpoint_keeps_the_trained_buffers(tmp_path):
    _, straight = _fit(epochs=2)
    first, _ = _fit(epochs=1)
    first.save_checkpoint(tmp_path / "epoch1.ckpt")
    saved = torch.load(tmp_path / "epoch1.ckpt", weights_only=False)["state_dict"]
    assert "hidden.base_layer.weight" not in saved and "norm.running_mean" in saved  # adapter-only, with buffers

    _, resumed = _fit(epochs=2, ckpt_path=tmp_path / "epoch1.ckpt")
    assert float(resumed.loss_ema) != 0.0
    for name, buffer in straight.state_dict().items():  # the uninterrupted run's buffers and weights, exactly
        torch.testing.assert_close(resumed.state_dict()[name], buffer, rtol=0, atol=0, msg=name)


def _trained_and_fresh():
    """A fitted module's adapter-only state, and a fresh module transformed as it was."""
    trainer, trained = _fit(epochs=1)
    fresh = WithRunningStats()
    trainer.strategy.transform.apply(fresh, trainer.strategy.precision_plugin, torch.device("cpu"))
    return trainer.strategy.transform, adapter_checkpoint_state_dict(trained), trained, fresh


def test_lowprec_fsdps_loading_takes_an_adapter_only_checkpoint_with_buffers():
    from pl_lowprec.strategies.fsdp_checkpoints import load_full_state_dict

    _, state, trained, fresh = _trained_and_fresh()
    load_full_state_dict(fresh, state, adapter_only=True)  # as lowprec_fsdp loads it, here on an unsharded module
    torch.testing.assert_close(fresh.norm.running_var, trained.norm.running_var, rtol=0, atol=0)


def test_export_reads_an_adapter_only_checkpoint_with_buffers_as_adapter_only():
    from pl_lowprec.export.restore import _load

    transform, state, trained, fresh = _trained_and_fresh()
    _load(fresh, transform, state, "epoch1.ckpt")  # not taken for a full checkpoint missing the base weights
    torch.testing.assert_close(fresh.loss_ema, trained.loss_ema, rtol=0, atol=0)
