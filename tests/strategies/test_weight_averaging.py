"""Lightning's weight-averaging callbacks copy the module before the strategy adapts it: refused before any step
where LoRA or quantization replace its layers (they failed inside the callback after training)."""

import pytest
import torch
from lightning.pytorch.callbacks import EMAWeightAveraging, StochasticWeightAveraging
from lightning_helpers import HIDDEN_LORA, Classifier, classification_loader, quiet_trainer
from torch import nn

from pl_lowprec import LowPrecisionStrategy

pytest.importorskip("peft")


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden = nn.Linear(8, 8)
        self.out = nn.Linear(8, 2)

    def forward(self, x):
        return self.out(torch.relu(self.hidden(x)))


@pytest.mark.parametrize("averaging", [StochasticWeightAveraging(swa_lrs=1e-2), EMAWeightAveraging()])
def test_weight_averaging_under_lora_is_refused_before_any_step(averaging):
    module = Classifier(Net())
    trainer = quiet_trainer(strategy=LowPrecisionStrategy(lora=HIDDEN_LORA), max_epochs=2, callbacks=[averaging])
    with pytest.raises(
        ValueError, match=rf"callbacks=\[{type(averaging).__name__}\(\.\.\.\)\]\) cannot average"
    ) as err:
        trainer.fit(module, classification_loader())
    assert "before the strategy changes its layers (lora=)" in str(err.value)
    assert "Remove the callback" in str(err.value) and "without lora= and quantization=" in str(err.value)
    assert trainer.global_step == 0
