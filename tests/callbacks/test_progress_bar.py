"""The training bar's total counts the batches that ``max_steps`` takes, with accumulation and on resume."""

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

from pl_lowprec.callbacks import StepLimitedRichProgressBar, StepLimitedTQDMProgressBar


class RecordingRichBar(StepLimitedRichProgressBar):
    """Keeps the training bar's (completed, total) as the run ends."""

    def on_train_end(self, trainer, pl_module):
        task = self.progress.tasks[self.train_progress_bar_id]
        self.final = (task.completed, task.total)
        super().on_train_end(trainer, pl_module)


class RecordingTQDMBar(StepLimitedTQDMProgressBar):
    def on_train_end(self, trainer, pl_module):
        self.final = (self.train_progress_bar.n, self.train_progress_bar.total)
        super().on_train_end(trainer, pl_module)


BARS = [RecordingRichBar, RecordingTQDMBar]


def _fit(bar_class, max_steps, accumulate=1, ckpt_path=None, module=None):
    bar = bar_class()
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=max_steps,
        accumulate_grad_batches=accumulate,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=[bar],
    )
    trainer.fit(BoringModel() if module is None else module, ckpt_path=ckpt_path)  # 64 batches an epoch
    return trainer, bar


@pytest.mark.parametrize("bar_class", BARS)
@pytest.mark.parametrize(("max_steps", "accumulate", "final"), [(3, 2, (6, 6)), (3, 1, (3, 3)), (40, 2, (16, 16))])
def test_bar_ends_full_at_max_steps(bar_class, max_steps, accumulate, final):
    # (40, 2): 32 steps fill the first epoch's 64 batches, the second epoch's 8 steps take 16 batches
    _, bar = _fit(bar_class, max_steps, accumulate)
    assert bar.final == final


def test_the_rich_label_names_max_steps_and_the_batches_a_step_takes():
    _, bar = _fit(RecordingRichBar, 3, 2)
    assert bar._get_train_description(0).strip() == "Epoch 0 (max_steps=3, 2 batches a step)"
    _, bar = _fit(RecordingRichBar, 3, 1)
    assert bar._get_train_description(0).strip() == "Epoch 0 (max_steps=3)"


@pytest.mark.parametrize("bar_class", BARS)
def test_resumed_epoch_counts_on_from_its_batch(tmp_path, bar_class):
    trainer, _ = _fit(bar_class, 3, 2)
    trainer.save_checkpoint(tmp_path / "step3.ckpt")
    resumed, bar = _fit(bar_class, 5, 2, ckpt_path=tmp_path / "step3.ckpt")
    assert resumed.global_step == 5
    assert bar.final == (10, 10)  # batches 7-10 of the epoch, after the 6 before the checkpoint


def test_lightnings_own_bars_become_step_limited_in_place_keeping_their_settings():
    from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

    from pl_lowprec.callbacks.progress import use_step_limited_progress_bars

    class Own(TQDMProgressBar):
        pass

    for named, ours in (
        (RichProgressBar(refresh_rate=7, leave=True), StepLimitedRichProgressBar),
        (TQDMProgressBar(refresh_rate=7, leave=True), StepLimitedTQDMProgressBar),
    ):
        trainer = pl.Trainer(accelerator="cpu", logger=False, callbacks=[named])
        use_step_limited_progress_bars(trainer)
        assert trainer.progress_bar_callback is named  # the same object: what Lightning set up stays
        assert type(named) is ours
        assert (named.refresh_rate, named._leave) == (7, True)
    trainer = pl.Trainer(accelerator="cpu", logger=False, callbacks=[Own()])
    use_step_limited_progress_bars(trainer)
    assert type(trainer.progress_bar_callback) is Own


def test_a_plain_trainer_on_the_package_strategy_labels_its_bar_by_max_steps():
    """Lightning's own bar, on a plain ``Trainer``, read ``Epoch 0/-2`` under ``max_steps``."""
    import pl_lowprec  # noqa: F401  (registers the strategy names)

    trainer = pl.Trainer(
        accelerator="cpu",
        strategy="lowprec",
        max_steps=2,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(BoringModel())
    bar = trainer.progress_bar_callback
    assert type(bar) is StepLimitedRichProgressBar
    assert bar._get_train_description(0).strip() == "Epoch 0 (max_steps=2)"


class ManualOptimizers(BoringModel):
    """Manual optimization: optimizer 0 steps every batch, optimizer 1 every ``second_every``-th batch."""

    def __init__(self, second_every: int = 1) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.second_every = second_every

    def training_step(self, batch, batch_idx):
        first, second = self.optimizers()
        self.manual_backward(self.step(batch))
        first.step()
        if batch_idx % self.second_every == 0:
            second.step()
        first.zero_grad()
        second.zero_grad()

    def configure_optimizers(self):
        return torch.optim.SGD([self.layer.weight], lr=0.1), torch.optim.SGD([self.layer.bias], lr=0.1)


@pytest.mark.parametrize("bar_class", BARS)
@pytest.mark.parametrize(("second_every", "max_steps", "final"), [(1, 8, (4, 4)), (2, 9, (6, 6)), (1, 200, (36, 36))])
def test_two_manual_optimizers_end_the_bar_full(bar_class, second_every, max_steps, final):
    """global_step counts both optimizers' steps: 8 steps are 4 batches, but the bar's total was 8 and it ended at
    4/8. Where one optimizer steps every other batch the total follows the steps the batches took (9 in 6); 200
    steps take the first epoch's 64 batches (128 steps) and 36 of the second."""
    _, bar = _fit(bar_class, max_steps, module=ManualOptimizers(second_every))
    assert bar.final == final
    if bar_class is RecordingRichBar and max_steps < 200:
        assert f"(max_steps={max_steps}, " in bar._get_train_description(0)
