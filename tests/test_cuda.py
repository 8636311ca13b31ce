"""The same behaviour on a CUDA GPU (skipped without one; CI has none)."""

import copy

import lightning.pytorch as pl
import pytest
import torch
from lightning_helpers import Classifier, quiet_trainer
from plain_amp_loop import make_classification_data, make_mlp, train_plain_loop
from qlora_helpers import LossRecorder, ids_loader, tiny_llama

from pl_lowprec import AMPPrecision, LowPrecisionStrategy

pytestmark = pytest.mark.cuda


class _BaseWeightDevice(pl.Callback):
    def __init__(self) -> None:
        self.seen: set[str] = set()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.seen.add(pl_module.model.model.layers[0].self_attn.q_proj.base_layer.weight.device.type)


def test_fp16_matches_the_plain_loop_on_cuda():
    loader = torch.utils.data.DataLoader(make_classification_data(n=20 * 4 * 8), batch_size=8)
    reference = make_mlp().cuda()
    model = copy.deepcopy(reference)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    train_plain_loop(reference, loader, opt, precision="16-mixed", accumulate=4, clip=1.0, device="cuda")
    plugin = AMPPrecision("16-mixed")
    trainer = quiet_trainer(
        accelerator="gpu", plugins=[plugin], max_epochs=1, accumulate_grad_batches=4, gradient_clip_val=1.0
    )
    trainer.fit(Classifier(model), loader)
    assert plugin.device == "cuda" and trainer.strategy.root_device.type == "cuda"
    for ours, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours.cuda(), theirs)  # Lightning's teardown moved the model back to the CPU


def test_qlora_trains_on_cuda_with_the_registered_strategy_device():
    pytest.importorskip("bitsandbytes")
    losses, devices = LossRecorder(), _BaseWeightDevice()
    strategy = LowPrecisionStrategy(quantization="nf4-dq", lora={"r": 8}, activation_checkpointing="LlamaDecoderLayer")
    model = tiny_llama()
    trainer = quiet_trainer(
        accelerator="gpu",
        strategy=strategy,
        plugins=[AMPPrecision("16-mixed")],
        max_steps=5,
        callbacks=[losses, devices],
    )
    trainer.fit(model, ids_loader())
    assert trainer.strategy.root_device.type == "cuda"
    assert devices.seen == {"cuda"}  # read during training: teardown moves the model back to the CPU
    assert all(torch.isfinite(torch.tensor(losses.losses)))
