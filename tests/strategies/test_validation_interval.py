"""An integer ``val_check_interval`` past the epoch's training batches is refused before the model loads
(``strategies/trainer_checks.py``); Lightning itself refuses it only once its fit loop starts."""

import pytest
from lightning_helpers import quiet_trainer
from qlora_helpers import ids_loader, tiny_llama

import pl_lowprec
from pl_lowprec import LowPrecisionStrategy
from pl_lowprec.transforms.pipeline import ModelTransform


@pytest.mark.usefixtures("no_process_group_left")
@pytest.mark.parametrize("strategy_class", ["LowPrecisionStrategy", "LowPrecisionFSDPStrategy"])
def test_a_validation_interval_past_the_epoch_is_refused_before_the_model_loads(monkeypatch, strategy_class):
    """Lightning refuses it only once its fit loop starts, after the model has been loaded and transformed."""
    applied = []
    monkeypatch.setattr(ModelTransform, "apply", lambda self, *args: applied.append(args))
    strategy = getattr(pl_lowprec, strategy_class)()
    trainer = quiet_trainer(strategy=strategy, max_steps=1, val_check_interval=6, limit_train_batches=5)
    with pytest.raises(ValueError) as refused:
        trainer.fit(tiny_llama(), ids_loader(batches=8), ids_loader(batches=1))
    assert str(refused.value).startswith(
        "Trainer(val_check_interval=6) is more than the 5 training batches of an epoch here, so Lightning would"
    )
    assert "check_val_every_n_epoch=None" in str(refused.value) and applied == []


def test_a_validation_interval_within_the_epoch_or_across_epochs_trains():
    for interval, every_n_epochs in ((5, 1), (6, None)):  # None: Lightning counts batches across epochs
        trainer = quiet_trainer(
            strategy=LowPrecisionStrategy(),
            max_steps=6,
            val_check_interval=interval,
            check_val_every_n_epoch=every_n_epochs,
            limit_train_batches=5,
            limit_val_batches=1,
        )
        trainer.fit(tiny_llama(), ids_loader(batches=8), ids_loader(batches=1))
        assert trainer.global_step == 6


def test_resuming_from_a_checkpoint_is_refused_before_the_checkpoint_is_loaded(monkeypatch, tmp_path):
    """Resuming, the strategy transforms and loads in ``load_model_state_dict``, which runs before ``setup``."""
    first = quiet_trainer(strategy=LowPrecisionStrategy(lora={"r": 4}), max_steps=2, limit_val_batches=0)
    first.fit(tiny_llama(), ids_loader(batches=8))
    first.save_checkpoint(tmp_path / "two.ckpt")
    applied = []
    monkeypatch.setattr(ModelTransform, "apply", lambda self, *args: applied.append(args))
    again = quiet_trainer(
        strategy=LowPrecisionStrategy(lora={"r": 4}), max_steps=4, val_check_interval=6, limit_train_batches=5
    )
    with pytest.raises(ValueError, match=r"val_check_interval=6\) is more than the 5 training batches"):
        again.fit(tiny_llama(), ids_loader(batches=8), ids_loader(batches=1), ckpt_path=tmp_path / "two.ckpt")
    assert applied == []
