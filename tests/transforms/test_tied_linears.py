"""A linear layer tied to a trained embedding is not quantized into an untied copy without a word."""

import lightning.pytorch as pl
import pytest
import torch
from lightning_helpers import quiet_trainer
from torch import nn
from torch.nn import functional as F

from pl_lowprec import LowPrecisionStrategy, QuantizationConfig

pytest.importorskip("bitsandbytes")


class TiedOutput(pl.LightningModule):
    """A module of one's own whose output layer, ``proj`` (a name the default skip_modules does not know), shares
    the embedding's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.hidden = nn.Linear(8, 8)
        self.proj = nn.Linear(8, 16, bias=False)
        self.proj.weight = self.emb.weight

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self.proj(self.hidden(self.emb(batch[:, :-1]))).flatten(0, 1), batch[:, 1:].flatten())

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def _fit(module, **strategy):
    ids = torch.randint(0, 16, (8, 6), generator=torch.Generator().manual_seed(0))
    trainer = quiet_trainer(strategy=LowPrecisionStrategy(**strategy), max_steps=2)
    trainer.fit(module, torch.utils.data.DataLoader(ids, batch_size=4))
    return trainer


def test_quantizing_a_layer_tied_to_a_trained_embedding_is_refused_with_the_skip_list_that_keeps_it():
    module = TiedOutput()
    with pytest.raises(
        ValueError,
        match=r"quantization='nf4' would replace proj \(tied to emb\) by a quantized copy.*proj would stop following"
        r" emb.*QuantizationConfig\(mode='nf4', skip_modules=\['proj'\]\)",
    ):
        _fit(module, quantization="nf4")
    assert module.proj.weight is module.emb.weight


def test_the_suggested_skip_list_keeps_the_tie_and_trains_both():
    module = TiedOutput()
    before = module.emb.weight.detach().clone()
    _fit(module, quantization=QuantizationConfig(mode="nf4", skip_modules=["proj"]))
    assert type(module.hidden).__name__ == "Linear4bit" and type(module.proj) is nn.Linear
    assert module.proj.weight is module.emb.weight and not torch.equal(module.emb.weight.detach(), before)


def test_with_lora_the_tied_weight_is_frozen_and_the_layer_is_quantized():
    pytest.importorskip("peft")
    module = TiedOutput()
    _fit(module, quantization="nf4", lora={"r": 2})
    assert type(module.proj.base_layer).__name__ == "Linear4bit" and not module.emb.weight.requires_grad
