"""Lightning's tuners under the strategies: ``lr_find`` and ``scale_batch_size`` save the model, run trial steps and
restore it. That restore is no resumption: the next ``fit`` follows the user's seed, as under Lightning's strategy."""

import warnings

import pytest
import torch
from lightning.pytorch.callbacks import BatchSizeFinder, LearningRateFinder
from lightning.pytorch.tuner import Tuner
from lightning_helpers import quiet_trainer
from qlora_helpers import LossRecorder

from pl_lowprec import LowPrecisionStrategy
from pl_lowprec.demo.tiny_gpt import TinyGPT


class RandomAtEachBatch(LossRecorder):
    """The global generator's state as each training batch starts, and the losses."""

    def __init__(self) -> None:
        super().__init__()
        self.states: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.states.append(torch.get_rng_state())


def _model_and_rows() -> tuple[TinyGPT, list[dict]]:
    torch.manual_seed(0)
    model = TinyGPT(dim=16, layers=1, heads=2, max_len=32, warmup_steps=1)
    return model, [{"input_ids": r} for r in torch.randint(0, 256, (8, 17))]


def _tune_reseed_and_fit(strategy, tune: str) -> RandomAtEachBatch:
    model, rows = _model_and_rows()
    model.train_dataloader = lambda: torch.utils.data.DataLoader(rows, batch_size=4, shuffle=True)
    record = RandomAtEachBatch()
    trainer = quiet_trainer(strategy=strategy, max_steps=4, limit_val_batches=0, callbacks=[record])
    if tune == "lr_find":
        Tuner(trainer).lr_find(model, num_training=3, update_attr=False)
    else:
        model.batch_size = 4
        Tuner(trainer).scale_batch_size(model, max_trials=1, steps_per_trial=1)
    record.states.clear(), record.losses.clear()
    torch.manual_seed(123)
    trainer.fit(model)  # 2 epochs of 2 batches: the second epoch's shuffle draws from the generator too
    return record


@pytest.mark.parametrize("tune", ["lr_find", "scale_batch_size"])
def test_a_fit_after_a_tuner_follows_the_users_seed_as_under_lightnings_strategy(tune):
    lightning = _tune_reseed_and_fit("auto", tune)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*resumes at step")  # no run resumed
        ours = _tune_reseed_and_fit(LowPrecisionStrategy(), tune)
    assert len(ours.states) == 4
    assert all(torch.equal(a, b) for a, b in zip(ours.states, lightning.states, strict=True))
    assert ours.losses == lightning.losses


def test_a_resumption_on_the_trainer_of_an_earlier_fit_is_still_one(tmp_path):
    """The checkpoint of ``fit(ckpt_path=...)`` loads before the strategy's setup: what the earlier fit's training
    left must not make it look like a tuner's restore."""
    model, rows = _model_and_rows()
    loader = torch.utils.data.DataLoader(rows, batch_size=4, shuffle=True)
    trainer = quiet_trainer(strategy=LowPrecisionStrategy(), max_steps=1, limit_val_batches=0)
    trainer.fit(model, loader)
    trainer.save_checkpoint(tmp_path / "step1.ckpt")
    trainer.fit_loop.epoch_loop.max_steps = 2
    with pytest.warns(UserWarning, match="This run resumes at step 1, inside epoch"):  # the resumption's warning
        trainer.fit(model, loader, ckpt_path=tmp_path / "step1.ckpt")


FINDERS = {
    "LearningRateFinder": lambda: LearningRateFinder(num_training_steps=2, update_attr=False),
    "BatchSizeFinder": lambda: BatchSizeFinder(max_trials=1, steps_per_trial=1),
}


@pytest.mark.parametrize("finder", FINDERS)
def test_a_tuner_callback_in_a_resumed_fit_is_refused_before_any_step(tmp_path, finder):
    """The callback's own restore dropped the checkpoint being resumed: the fit kept its weights but trained again
    from step 0 with fresh optimizer moments (under Lightning's strategies too), saying only that the run
    "resumes at step 0". Refused as the checkpoint loads, naming the callback and the ways to tune."""
    model, rows = _model_and_rows()
    model.batch_size = 4
    model.train_dataloader = lambda: torch.utils.data.DataLoader(rows, batch_size=model.batch_size)
    quiet_trainer(strategy=LowPrecisionStrategy(), max_steps=2, limit_val_batches=0).fit(model)
    checkpoint = tmp_path / "step2.ckpt"
    model.trainer.save_checkpoint(checkpoint)
    trained = {name: param.detach().clone() for name, param in model.named_parameters()}
    resumed = quiet_trainer(
        strategy=LowPrecisionStrategy(), max_steps=4, limit_val_batches=0, callbacks=[FINDERS[finder]()]
    )
    with pytest.raises(ValueError) as refused:
        resumed.fit(model, ckpt_path=checkpoint)
    message = str(refused.value)
    assert f"fit(ckpt_path={str(checkpoint)!r}) resumes a run, and Trainer(callbacks=[{finder}(...)])" in message
    assert "start again at step 0" in message and "Tuner(trainer).lr_find(model)" in message
    assert resumed.global_step == 0
    assert all(torch.equal(param, trained[name]) for name, param in model.named_parameters())


def test_a_tuner_callback_in_a_fit_that_resumes_nothing_runs():
    """The callback's own restore (after its trial steps) is no resumption: nothing refused."""
    model, rows = _model_and_rows()
    model.train_dataloader = lambda: torch.utils.data.DataLoader(rows, batch_size=4)
    trainer = quiet_trainer(
        strategy=LowPrecisionStrategy(), max_steps=2, limit_val_batches=0, callbacks=[FINDERS["LearningRateFinder"]()]
    )
    trainer.fit(model)
    assert trainer.global_step == 2
