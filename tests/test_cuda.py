"""The same behaviour on a CUDA GPU (skipped without one; CI has none)."""

import copy

import pytest
import torch
from lightning_helpers import Classifier, quiet_trainer
from plain_amp_loop import make_classification_data, make_mlp, train_plain_loop
from qlora_helpers import LossRecorder, ids_loader, tiny_llama

from pl_lowprec import AMPPrecision, LowPrecisionStrategy

pytestmark = pytest.mark.cuda


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
        torch.testing.assert_close(ours, theirs)


def test_qlora_trains_on_cuda_with_the_registered_strategy_device():
    pytest.importorskip("bitsandbytes")
    losses = LossRecorder()
    strategy = LowPrecisionStrategy(quantization="nf4-dq", lora={"r": 8}, activation_checkpointing="LlamaDecoderLayer")
    model = tiny_llama()
    trainer = quiet_trainer(
        accelerator="gpu", strategy=strategy, plugins=[AMPPrecision("16-mixed")], max_steps=5, callbacks=[losses]
    )
    trainer.fit(model, ids_loader())
    assert trainer.strategy.root_device.type == "cuda"
    assert model.model.model.layers[0].self_attn.q_proj.base_layer.weight.device.type == "cuda"
    assert all(torch.isfinite(torch.tensor(losses.losses)))
