"""An optimizer over parameters collected before the transform is refused: it would train nothing."""

import lightning.pytorch as pl
import pytest
import torch
from lightning_helpers import HIDDEN_LORA, classification_loader, quiet_trainer
from torch import nn
from torch.nn import functional as F

from pl_lowprec import LowPrecisionStrategy

pytest.importorskip("peft")


class ParamsFromInit(pl.LightningModule):
    """Builds its optimizer from lists made in ``__init__`` (``early=True``), as a plain Lightning run allows, or
    from ``self.named_parameters()`` in ``configure_optimizers``."""

    def __init__(self, early: bool) -> None:
        super().__init__()
        self.hidden = nn.Linear(8, 8)
        self.out = nn.Linear(8, 2)
        self.early = early
        self.decayed = [p for p in self.parameters() if p.ndim >= 2]
        self.not_decayed = [p for p in self.parameters() if p.ndim < 2]

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.out(self.hidden(x)), y)

    def configure_optimizers(self):
        if self.early:
            decayed, not_decayed = self.decayed, self.not_decayed
        else:
            trainable = [(n, p) for n, p in self.named_parameters() if p.requires_grad]
            decayed = [p for _, p in trainable if p.ndim >= 2]
            not_decayed = [p for _, p in trainable if p.ndim < 2]
        groups = [{"params": decayed, "weight_decay": 0.1}, {"params": not_decayed, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=1e-2)


@pytest.mark.parametrize(
    ("strategy", "foreign"),
    [({"lora": HIDDEN_LORA}, ""), ({"quantization": "nf4", "lora": HIDDEN_LORA}, r", 4 of them no longer the model's")],
)
def test_parameters_collected_before_the_transform_are_refused_before_the_first_step(strategy, foreign):
    if "quantization" in strategy:
        pytest.importorskip("bitsandbytes")
    module = ParamsFromInit(early=True)
    trainer = quiet_trainer(strategy=LowPrecisionStrategy(**strategy), max_steps=2)
    with pytest.raises(
        ValueError,
        match=rf"configure_optimizers returned optimizers over 4 parameters{foreign}, and 2 of the model's 2"
        r" trainable parameters are in none of them \(e\.g\. hidden\.lora_A\.default\.weight\).*build the"
        r" optimizer from self\.parameters\(\)",
    ):
        trainer.fit(module, classification_loader())
    assert trainer.global_step == 0


def test_parameters_read_in_configure_optimizers_train_the_adapters():
    module = ParamsFromInit(early=False)
    trainer = quiet_trainer(strategy=LowPrecisionStrategy(lora=HIDDEN_LORA), max_steps=2)
    trainer.fit(module, classification_loader())
    assert trainer.global_step == 2
    assert module.hidden.lora_B.default.weight.abs().max() > 0  # B starts at zero: it trained
    assert [g["weight_decay"] for g in trainer.optimizers[0].param_groups] == [0.1, 0.0]


def test_a_module_that_optimizes_only_part_of_what_it_trains_without_lora_is_left_alone():
    """Without adapters, an optimizer over some of the trainable parameters is the user's choice, as in Lightning."""

    class OnlyTheHead(ParamsFromInit):
        def configure_optimizers(self):
            return torch.optim.SGD(self.out.parameters(), lr=0.1)

    trainer = quiet_trainer(strategy=LowPrecisionStrategy(), max_steps=1)
    trainer.fit(OnlyTheHead(early=False), classification_loader())
    assert trainer.global_step == 1
