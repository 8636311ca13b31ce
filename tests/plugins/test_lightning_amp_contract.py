"""Lightning's own contract for its ``MixedPrecision`` plugin, with ``AMPPrecision`` in its place.

One test for each test of Lightning 2.6.5's ``tests/tests_pytorch/plugins/precision/test_amp.py`` and
``test_amp_integration.py`` (2.6.6, the pinned version, ships the same ``amp.py``), under the same name and
checking the same thing. They are written here rather than copied, and Lightning's CUDA-only integration tests
also run on CPU, where ``AMPPrecision`` does real fp16 with a ``GradScaler("cpu")``; on a GPU they run on CUDA too
(``cuda`` marker). The one deliberate difference is skipped with its reason: ``AMPPrecision`` refuses fused
optimizers, which hide skipped steps from its accounting.
"""

from unittest.mock import Mock

import pytest
import torch
from lightning.pytorch import Trainer, seed_everything
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import nn
from torch.optim import Optimizer

from pl_lowprec import AMPPrecision

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def _skip_without_cuda(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def test_clip_gradients():
    """Clipping off touches nothing; on, it calls exactly the clip its algorithm names."""
    optimizer = Mock(spec=Optimizer)  # no param_groups: anything that reads them fails
    precision = AMPPrecision(precision="16-mixed", device="cuda:0", scaler=Mock())
    precision.clip_grad_by_value = Mock()
    precision.clip_grad_by_norm = Mock()
    precision.clip_gradients(optimizer)
    precision.clip_grad_by_value.assert_not_called()
    precision.clip_grad_by_norm.assert_not_called()

    precision.clip_gradients(optimizer, clip_val=1.0, gradient_clip_algorithm=GradClipAlgorithmType.VALUE)
    precision.clip_grad_by_value.assert_called_once()
    precision.clip_grad_by_norm.assert_not_called()

    precision.clip_grad_by_value.reset_mock()
    precision.clip_grad_by_norm.reset_mock()
    precision.clip_gradients(optimizer, clip_val=1.0, gradient_clip_algorithm=GradClipAlgorithmType.NORM)
    precision.clip_grad_by_value.assert_not_called()
    precision.clip_grad_by_norm.assert_called_once()


def test_optimizer_amp_scaling_support_in_step_method():
    """An optimizer that unscales inside its own step (fused Adam) cannot be clipped."""
    optimizer = Mock(_step_supports_amp_scaling=True)
    precision = AMPPrecision(precision="16-mixed", device="cuda:0", scaler=Mock())
    with pytest.raises(RuntimeError, match=r"The current optimizer.*does not allow for gradient clipping"):
        precision.clip_gradients(optimizer, clip_val=1.0)


def test_amp_with_no_grad():
    """A ``no_grad`` block inside the plugin's autocast does not break gradient tracking after it."""
    layer = nn.Linear(2, 1)
    x = torch.randn(1, 2)
    amp = AMPPrecision(precision="bf16-mixed", device="cpu")
    with amp.autocast_context_manager():
        with torch.no_grad():
            _ = layer(x)
        loss = layer(x).mean()
        loss.backward()
        assert loss.grad_fn is not None


class FusedOptimizerParityModel(BoringModel):
    def __init__(self, fused: bool = False) -> None:
        super().__init__()
        self.fused = fused

    def configure_optimizers(self):
        assert isinstance(self.trainer.precision_plugin.scaler, torch.amp.GradScaler)
        return torch.optim.Adam(self.parameters(), lr=1.0, fused=self.fused)


@pytest.mark.skip(
    reason="Deliberate difference: AMPPrecision refuses Adam(fused=True), whose kernel unscales and skips"
    " overflowing steps inside itself, out of reach of AMPPrecision's skipped-step accounting and of gradient"
    " clipping (test_refuses_a_fused_optimizer_with_its_reason checks the refusal)."
)
def test_amp_fused_optimizer_parity(tmp_path):
    pass


def test_refuses_a_fused_optimizer_with_its_reason(tmp_path):
    trainer = Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        plugins=[AMPPrecision("16-mixed")],
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with pytest.raises(ValueError, match=r"Adam\(fused=True\) unscales and skips inside its fused kernel"):
        trainer.fit(FusedOptimizerParityModel(fused=True))


@pytest.mark.parametrize("device", DEVICES)
def test_skip_training_step_with_grad_scaler(device):
    """A ``training_step`` that returns ``None`` skips the scaler too: one unscale, step and update per real step,
    through the scaler the plugin holds (here Lightning's ``Mock`` around it)."""
    _skip_without_cuda(device)
    seed_everything(0)

    class TestModel(BoringModel):
        def training_step(self, batch, batch_idx):
            if batch_idx % 2:
                return None  # skipping the backward should skip the grad scaler too
            return super().training_step(batch, batch_idx)

    trainer = Trainer(
        accelerator=device,
        devices=1,
        plugins=[AMPPrecision("16-mixed")],
        barebones=True,
        max_steps=5,
        gradient_clip_val=0.5,
    )
    assert isinstance(trainer.precision_plugin, MixedPrecision)
    assert trainer.precision_plugin.scaler is not None
    trainer.precision_plugin.scaler = Mock(wraps=trainer.precision_plugin.scaler)
    trainer.fit(TestModel())
    assert trainer.precision_plugin.scaler.unscale_.call_count == 3
    assert trainer.precision_plugin.scaler.step.call_count == 3
    assert trainer.precision_plugin.scaler.update.call_count == 3
