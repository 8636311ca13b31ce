"""StepBoundaryCheckpoint saves only where an optimizer step ends and saves the run's final step, so that ``last.ckpt``
holds the trained model and every checkpoint resumes to the uninterrupted run's weights; Lightning's own class
is the reference that fails each case."""

import signal
import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from lightning_helpers import StepRecorder
from qlora_helpers import LossRecorder
from resume_helpers import ACCUMULATE, EVERY, FailAt, Failure, Regression, UpdateRaisesHalfway, fit

from pl_lowprec import AMPPrecision, LowPrecisionStrategy
from pl_lowprec.callbacks import StepBoundaryCheckpoint
from pl_lowprec.callbacks.exception_guard import trainer_guard
from pl_lowprec.callbacks.interrupted_update import UpdateWatch
from pl_lowprec.callbacks.step_boundary_checkpoint import use_step_boundary_checkpoints
from pl_lowprec.distributed import failing_ranks, launched_ranks


def saved(path):
    checkpoint = torch.load(path, weights_only=False)
    return checkpoint["global_step"], checkpoint["state_dict"]["layer.weight"]


@pytest.mark.parametrize(
    ("checkpoint_class", "holds_the_end"),
    [(LightningModelCheckpoint, False), (StepBoundaryCheckpoint, True)],
    ids=["lightning", "pl_lowprec"],
)
# off the every-2-steps grid: step 3, and step 5 at the end of the one epoch
@pytest.mark.parametrize("end", [{"max_steps": 3}, {"max_epochs": 1}], ids=["max_steps", "max_epochs"])
def test_last_ckpt_holds_the_final_step_off_the_grid(tmp_path, checkpoint_class, holds_the_end, end):
    final = fit(tmp_path, checkpoint_class, **end)
    final_step = end.get("max_steps", 5)
    step, weight = saved(tmp_path / "last.ckpt")
    assert (step == final_step and torch.equal(weight, final)) is holds_the_end
    assert (tmp_path / f"epoch=0-step={final_step}.ckpt").is_file() is holds_the_end


@pytest.mark.parametrize(
    ("first", "then", "saved_step"),
    [({"max_steps": 3}, {"max_steps": 8}, 3), ({"max_epochs": 1}, {"max_epochs": 2}, 5)],
    ids=["max_steps", "max_epochs"],
)
def test_the_final_step_resumes_to_the_uninterrupted_weights(tmp_path, first, then, saved_step):
    uninterrupted = fit(tmp_path / "full", **then)
    fit(tmp_path / "part", **first)
    assert saved(tmp_path / "part/last.ckpt")[0] == saved_step
    assert torch.equal(fit(tmp_path / "part", ckpt_path=tmp_path / "part/last.ckpt", **then), uninterrupted)


@pytest.mark.parametrize(
    ("checkpoint_class", "exact"),
    [(LightningModelCheckpoint, False), (StepBoundaryCheckpoint, True)],
    ids=["lightning", "pl_lowprec"],
)
def test_a_run_stopped_inside_an_epoch_resumes_the_rest_of_it(tmp_path, checkpoint_class, exact):
    """Lightning's default schedule (at each epoch's end) saves a max_steps stop at step 3 of the 5-step epoch as a
    complete epoch: resumed, the run starts the next epoch and never sees the rest of this one."""
    uninterrupted = fit(tmp_path / "full", checkpoint_class, schedule={}, max_steps=8)
    fit(tmp_path / "part", checkpoint_class, schedule={}, max_steps=3)
    assert saved(tmp_path / "part/last.ckpt")[0] == 3
    resumed = fit(tmp_path / "part", checkpoint_class, ckpt_path=tmp_path / "part/last.ckpt", schedule={}, max_steps=8)
    assert torch.equal(resumed, uninterrupted) is exact


@pytest.mark.parametrize(
    ("checkpoint_class", "exact"),
    [(LightningModelCheckpoint, False), (StepBoundaryCheckpoint, True)],
    ids=["lightning", "pl_lowprec"],
)
def test_a_resumed_run_leaves_the_checkpoint_it_resumed_from_as_it_was(tmp_path, checkpoint_class, exact):
    """Resumed at step 2 on the grid, Lightning's class saves step 2 again after the first micro-batch, into the
    same file: a resumption from that file drops the micro-batch's gradients."""
    uninterrupted = fit(tmp_path / "full", checkpoint_class, max_steps=6)
    run = tmp_path / "run"
    fit(run, checkpoint_class, max_steps=2)
    before = (run / "epoch=0-step=2.ckpt").read_bytes()
    fit(run, checkpoint_class, ckpt_path=run / "last.ckpt", max_steps=4)
    assert ((run / "epoch=0-step=2.ckpt").read_bytes() == before) is exact
    again = fit(tmp_path / "again", checkpoint_class, ckpt_path=run / "epoch=0-step=2.ckpt", max_steps=6)
    assert torch.equal(again, uninterrupted) is exact


@pytest.mark.parametrize("epoch_scheduler", [False, True], ids=["", "epoch_scheduler"])
@pytest.mark.parametrize("checkpoint_class", [LightningModelCheckpoint, StepBoundaryCheckpoint])
def test_a_max_steps_run_resumes_a_checkpoint_saved_at_an_epochs_end_exactly(
    tmp_path, checkpoint_class, epoch_scheduler, caplog
):
    """Without validation, the default schedule saves at the training epoch's end (step 5, the epoch's last): under
    max_steps Lightning resumes it by training one batch of the next epoch alone and skipping the rest of that
    epoch. The strategies and StepBoundaryCheckpoint resume it as saved at the epoch's last batch: the uninterrupted
    weights."""
    uninterrupted = fit(tmp_path / "full", checkpoint_class, schedule={}, max_steps=12, epoch_scheduler=epoch_scheduler)
    fit(tmp_path / "part", checkpoint_class, schedule={}, max_steps=5, epoch_scheduler=epoch_scheduler)
    checkpoint = torch.load(tmp_path / "part/last.ckpt", weights_only=False)
    assert (
        checkpoint["global_step"] == 5 and checkpoint["loops"]["fit_loop"]["epoch_progress"]["total"]["processed"] == 1
    )
    resume = {"ckpt_path": tmp_path / "part/last.ckpt", "schedule": {}, "max_steps": 12}
    resume["epoch_scheduler"] = epoch_scheduler  # its step at the saved epoch's end is taken once, as uninterrupted
    # on Lightning's own strategy, Lightning's class is the reference that fails; this package's class fixes it
    exact_alone = checkpoint_class is StepBoundaryCheckpoint
    assert torch.equal(fit(tmp_path / "auto", checkpoint_class, **resume), uninterrupted) is exact_alone
    with caplog.at_level("INFO"):
        resumed = fit(tmp_path / "part", checkpoint_class, strategy=LowPrecisionStrategy(), **resume)
    assert torch.equal(resumed, uninterrupted)
    assert "saved at a training epoch's end: the run goes on from the next epoch's first batch" in caplog.text


def test_checkpoints_saved_elsewhere_keep_their_loop_state():
    """Only the training epoch's end is rewritten: not a validation's end, a batch's end or an epoch-based run."""
    from pl_lowprec.callbacks.epoch_end_resumption import as_saved_at_the_last_batch

    def loops(epoch, batch, last=True):
        progress = lambda r, s, p, c: {"ready": r, "started": s, "processed": p, "completed": c}  # noqa: E731
        batches = {"total": progress(*batch), "current": progress(*batch), "is_last_batch": last}
        fit_loop = {"epoch_progress": {"total": progress(*epoch), "current": progress(*epoch)}}
        state = {"_batches_that_stepped": 5}
        return {
            "loops": {"fit_loop": fit_loop | {"epoch_loop.batch_progress": batches, "epoch_loop.state_dict": state}}
        }

    epoch_end = loops((1, 1, 1, 0), (10, 10, 10, 10))
    assert as_saved_at_the_last_batch(epoch_end, max_steps=8)
    expected = loops((1, 1, 0, 0), (10, 10, 10, 9))  # the same step saved at the last batch's end
    expected["loops"]["fit_loop"]["epoch_loop.state_dict"]["_batches_that_stepped"] = 4
    assert epoch_end == expected
    for elsewhere, max_steps in [
        (loops((1, 1, 1, 0), (10, 10, 10, 10)), -1),  # an epoch-based run: Lightning resumes it exactly
        (loops((1, 1, 0, 0), (10, 10, 10, 10)), 8),  # the validation's end
        (loops((1, 1, 0, 0), (10, 10, 10, 9)), 8),  # the last batch's end
        (loops((1, 1, 0, 0), (4, 4, 4, 3), last=False), 8),  # inside the epoch
    ]:
        before = repr(elsewhere)
        assert not as_saved_at_the_last_batch(elsewhere, max_steps)
        assert repr(elsewhere) == before


def test_resuming_from_a_mid_step_checkpoint_warns_with_the_micro_batches_it_lacks(tmp_path):
    run = tmp_path / "run"
    fit(run, LightningModelCheckpoint, max_steps=2)
    fit(run, LightningModelCheckpoint, ckpt_path=run / "last.ckpt", max_steps=4)  # rewrites step 2 mid-step
    with pytest.warns(UserWarning, match=r"after 1 of the 2 micro-batches of optimizer step 3 .* remaining 1 micro"):
        fit(tmp_path / "a", ckpt_path=run / "epoch=0-step=2.ckpt", max_steps=6, strategy=LowPrecisionStrategy())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(tmp_path / "b", ckpt_path=run / "epoch=0-step=4.ckpt", max_steps=6, strategy=LowPrecisionStrategy())
    assert not [w for w in caught if "micro-batches of optimizer step" in str(w.message)]


def test_lightnings_own_class_becomes_this_one_in_place_and_a_subclass_is_left_as_it_is(tmp_path):
    class Own(LightningModelCheckpoint):
        pass

    lightnings, own = LightningModelCheckpoint(dirpath=tmp_path, every_n_train_steps=3), Own(dirpath=tmp_path)
    trainer = pl.Trainer(accelerator="cpu", callbacks=[lightnings, own], logger=False, enable_progress_bar=False)
    state_key = lightnings.state_key
    use_step_boundary_checkpoints(trainer)
    assert [type(c) for c in trainer.checkpoint_callbacks] == [StepBoundaryCheckpoint, Own]
    assert trainer.checkpoint_callbacks[0] is lightnings and lightnings._every_n_train_steps == 3
    assert lightnings.state_key == state_key  # checkpoints of either class restore its state


def test_the_strategy_uses_it_for_lightnings_class(tmp_path):
    callback = LightningModelCheckpoint(dirpath=tmp_path, every_n_train_steps=EVERY, save_last=True)
    trainer = pl.Trainer(
        accelerator="cpu",
        strategy=LowPrecisionStrategy(),
        max_steps=3,
        accumulate_grad_batches=ACCUMULATE,
        callbacks=[callback],
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Regression())
    assert type(callback) is StepBoundaryCheckpoint and saved(tmp_path / "last.ckpt")[0] == 3


def with_dropout_on_the_strategy(checkpoint_class, dropout: float = 0.5) -> dict:
    """This package's class: with dropout, under a strategy that keeps the random states (Lightning keeps none, so
    no resumption with dropout is exact there); Lightning's reference: without either, on Lightning's strategy
    (this package's would turn it into this one)."""
    if checkpoint_class is StepBoundaryCheckpoint:
        return {"dropout": dropout, "strategy": LowPrecisionStrategy()}
    return {}


@pytest.mark.parametrize(
    ("checkpoint_class", "monitor", "saved_steps", "dropout"),
    [
        (LightningModelCheckpoint, None, [1, 3, 4, 6, 8], 0.0),
        (StepBoundaryCheckpoint, None, [2, 3, 5, 7, 8], 0.5),  # saved where the step ends
        (LightningModelCheckpoint, "val_loss", [1, 3, 4, 6, 8], 0.0),
        (StepBoundaryCheckpoint, "val_loss", [1, 3, 4, 6, 8], 0.5),  # the validated weights, as at the step's end
    ],
    ids=["lightning", "pl_lowprec", "lightning-monitored", "pl_lowprec-monitored"],
)
def test_a_validation_inside_an_accumulated_step_saves_a_file_that_resumes_exactly(
    tmp_path, checkpoint_class, monitor, saved_steps, dropout
):
    """Validating every 3 batches while accumulating 2, the default schedule saves at each validation's end: after
    batch 3, the first micro-batch of step 2, Lightning writes step 1 with the loop past that micro-batch and
    without its gradients, and a resumption from it takes step 2 on batch 4 alone (and so for steps 4 and 6)."""
    run = {"schedule": {"save_top_k": -1, "monitor": monitor}, "validate_every": 3, "max_steps": 8}
    uninterrupted = fit(
        tmp_path / "full", checkpoint_class, **run, **with_dropout_on_the_strategy(checkpoint_class, dropout)
    )
    files = sorted((tmp_path / "full").glob("epoch=*.ckpt"))
    assert sorted(torch.load(f, weights_only=False)["global_step"] for f in files) == saved_steps
    for file in files:
        on = with_dropout_on_the_strategy(checkpoint_class, dropout)
        resumed = fit(tmp_path / file.stem, checkpoint_class, ckpt_path=file, **run, **on)
        inside_a_step = checkpoint_class is LightningModelCheckpoint and file.stem.endswith(("=1", "=4", "=6"))
        assert torch.equal(resumed, uninterrupted) is not inside_a_step, file.name


class StopInsideAStep(pl.Callback):
    """Asks the run to stop after batch 9, the first micro-batch of step 5, as ``max_time`` or a callback may."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.fit_loop.total_batch_idx == 8:
            trainer.should_stop = True


@pytest.mark.parametrize(
    ("checkpoint_class", "holds_the_end"),
    [(LightningModelCheckpoint, False), (StepBoundaryCheckpoint, True)],
    ids=["lightning", "pl_lowprec"],
)
def test_a_run_stopped_inside_a_step_saves_its_final_step_which_resumes_exactly(
    tmp_path, checkpoint_class, holds_the_end
):
    """Saving every 3 steps, a run stopped inside step 5 ended at step 4: Lightning's last.ckpt holds step 3, and
    an export of it the adapters of a step before the end. Here it holds step 4, written as at step 4's end (its
    loop, data position and random states), so that a resumption trains batch 9 again, dropout masks and all."""
    run = {"schedule": {"every_n_train_steps": 3, "save_top_k": -1}, "max_steps": 8}
    uninterrupted = fit(tmp_path / "full", checkpoint_class, **run, **with_dropout_on_the_strategy(checkpoint_class))
    on = with_dropout_on_the_strategy(checkpoint_class)
    stopped = fit(tmp_path / "part", checkpoint_class, callbacks=[StopInsideAStep()], **run, **on)
    step, weight = saved(tmp_path / "part/last.ckpt")
    assert step == (4 if holds_the_end else 3) and torch.equal(weight, stopped) is holds_the_end
    on = with_dropout_on_the_strategy(checkpoint_class)
    resumed = fit(tmp_path / "part", checkpoint_class, ckpt_path=tmp_path / "part/last.ckpt", **run, **on)
    assert torch.equal(resumed, uninterrupted)


@pytest.mark.parametrize(
    ("hook", "batch"),
    [
        ("on_before_backward", 4),  # in step 3's first micro-batch: the file is at step 2's end but for the draws
        ("on_before_backward", 5),  # its second: step 3 would be taken on batch 5 alone
        ("on_before_optimizer_step", 5),
        ("on_train_batch_start", 5),
        ("on_train_batch_end", 4),
        ("on_train_batch_end", 5),  # step 3 ended, the callback did not see its end
    ],
)
def test_a_file_saved_on_an_exception_resumes_exactly(tmp_path, hook, batch):
    """``save_on_exception`` writes the failed run's state as it stands (Lightning's own ``OnExceptionCheckpoint``
    too): inside an accumulated step, the loop counts the step's micro-batches so far, whose gradients no file
    keeps, and the random generators stand after the failed batch's draws. Written as at the last step's end, the
    resumption trains the step's micro-batches again, with the uninterrupted run's dropout masks."""
    run = {"schedule": {"every_n_train_steps": 4, "save_on_exception": True}, "max_steps": 8}
    uninterrupted = fit(tmp_path / "full", **run, **with_dropout_on_the_strategy(StepBoundaryCheckpoint))
    with pytest.raises(Failure):
        on = with_dropout_on_the_strategy(StepBoundaryCheckpoint)
        fit(tmp_path / "part", callbacks=[FailAt(hook, batch)], **run, **on)
    assert saved(tmp_path / "part/last.ckpt")[0] == 2 + (hook == "on_train_batch_end" and batch == 5)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        on = with_dropout_on_the_strategy(StepBoundaryCheckpoint)
        resumed = fit(tmp_path / "part", ckpt_path=tmp_path / "part/last.ckpt", **run, **on)
    assert not [w for w in caught if "micro-batches of optimizer step" in str(w.message)]
    assert not [w for w in caught if "exception interrupted" in str(w.message)]
    assert torch.equal(resumed, uninterrupted)


@pytest.mark.parametrize("batch", [4, 5])
def test_a_file_lightnings_on_exception_checkpoint_wrote_inside_a_batch_is_said_on_resumption(tmp_path, batch):
    """Lightning's ``OnExceptionCheckpoint`` (another class: left as it is) writes the failed run as it stood: the
    failed batch is trained again, but with the generators past its first try's draws (and, inside a step, without
    the step's earlier micro-batches' gradients). Resuming from it was silent on a window's first micro-batch."""
    run = {"schedule": {"every_n_train_steps": 4}, "max_steps": 8, "dropout": 0.5}
    uninterrupted = fit(tmp_path / "full", strategy=LowPrecisionStrategy(), **run)
    on_exception = OnExceptionCheckpoint(tmp_path / "part")
    with pytest.raises(Failure):
        fit(
            tmp_path / "part",
            strategy=LowPrecisionStrategy(),
            callbacks=[FailAt("on_before_backward", batch), on_exception],
            **run,
        )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = fit(tmp_path / "part", strategy=LowPrecisionStrategy(), ckpt_path=on_exception.ckpt_path, **run)
    (said,) = [str(w.message) for w in caught if "exception interrupted" in str(w.message)]
    assert said.startswith(
        f"This checkpoint was written as an exception interrupted training batch {batch} of epoch 0, with the run's"
        " state as it stood (Lightning's OnExceptionCheckpoint"
    )
    assert ("after 1 of its 2 micro-batches" in said) is (batch == 5)
    assert "StepBoundaryCheckpoint(save_on_exception=True)" in said
    assert not [w for w in caught if "micro-batches of optimizer step" in str(w.message)]  # one paragraph, not two
    assert not torch.equal(resumed, uninterrupted)


class FailsAfterItsOptimizerStep(Regression):
    """A module whose own ``optimizer_step`` raises after ``optimizer.step`` on the run's batch ``failing_batch``:
    the weights stand at the new step, and Lightning has neither counted it nor stepped the scheduler."""

    failing_batch: int | None = None
    raised: type[BaseException] = Failure

    def optimizer_step(self, *args, **kwargs):
        super().optimizer_step(*args, **kwargs)
        if self.trainer.fit_loop.total_batch_idx == self.failing_batch:
            raise self.raised(f"after the optimizer step of batch {self.failing_batch}")


@pytest.mark.parametrize("raised", [Failure, KeyboardInterrupt])
@pytest.mark.parametrize("batch", [5, 9])  # step 3's end; step 5's, the epoch's last batch
def test_an_exception_after_the_optimizer_step_saves_a_file_with_the_step_counted_and_scheduled(
    tmp_path, monkeypatch, raised, batch
):
    """Raised after ``optimizer.step`` (a module's own ``optimizer_step``, Ctrl-C), before Lightning counted the
    step and stepped the scheduler: the file said step N-1 with step N's weights, and the resumption took step N
    again, its learning rate one step behind from there on. The step is finished first: LR and weights follow the
    uninterrupted run."""
    sigint = signal.getsignal(signal.SIGINT)
    run = {"schedule": {"every_n_train_steps": 4, "save_on_exception": True}, "max_steps": 8, "step_scheduler": True}
    on = with_dropout_on_the_strategy(StepBoundaryCheckpoint)
    full_steps = StepRecorder()
    uninterrupted = fit(tmp_path / "full", callbacks=[full_steps], module_class=FailsAfterItsOptimizerStep, **run, **on)
    monkeypatch.setattr(FailsAfterItsOptimizerStep, "failing_batch", batch)
    monkeypatch.setattr(FailsAfterItsOptimizerStep, "raised", raised)
    try:
        with pytest.raises(Failure if raised is Failure else SystemExit):
            on = with_dropout_on_the_strategy(StepBoundaryCheckpoint)
            fit(tmp_path / "part", module_class=FailsAfterItsOptimizerStep, **run, **on)
    finally:
        signal.signal(signal.SIGINT, sigint)
    monkeypatch.setattr(FailsAfterItsOptimizerStep, "failing_batch", None)
    step = (batch + 1) // ACCUMULATE
    saved_file = torch.load(tmp_path / "part/last.ckpt", weights_only=False)
    assert saved_file["global_step"] == step and saved_file["lr_schedulers"][0]["last_epoch"] == step
    resumed_steps = StepRecorder()
    on = with_dropout_on_the_strategy(StepBoundaryCheckpoint)
    resumed = fit(tmp_path / "part", ckpt_path=tmp_path / "part/last.ckpt", callbacks=[resumed_steps], **run, **on)
    assert resumed_steps.lrs == full_steps.lrs[step:]
    assert torch.equal(resumed, uninterrupted)


@pytest.mark.parametrize("batch", [5, 9])  # step 3's end; step 5's, the epoch's last batch
def test_lightnings_on_exception_checkpoint_after_the_optimizer_step_resumes_exactly(tmp_path, monkeypatch, batch):
    """The strategies' ``OnExceptionCheckpoint`` wrote, on an exception after ``optimizer.step`` (a module's own
    ``optimizer_step``), step N's weights with the loop before step N: the resumption trained step N's batch again
    (said as an interrupted batch whose draws differ, though its weights had taken it already). It finishes the step
    first, as ``save_on_exception`` does: the resumed losses and parameters are the uninterrupted run's."""
    run = {"schedule": {"every_n_train_steps": 4}, "max_steps": 8, "step_scheduler": True}
    on = with_dropout_on_the_strategy(StepBoundaryCheckpoint)
    full_steps, full_losses = StepRecorder(), LossRecorder()
    fit(tmp_path / "full", callbacks=[full_steps, full_losses], module_class=FailsAfterItsOptimizerStep, **run, **on)
    monkeypatch.setattr(FailsAfterItsOptimizerStep, "failing_batch", batch)
    on_exception = OnExceptionCheckpoint(tmp_path / "on_exception")
    with pytest.raises(Failure):
        on = with_dropout_on_the_strategy(StepBoundaryCheckpoint)
        fit(tmp_path / "part", callbacks=[on_exception], module_class=FailsAfterItsOptimizerStep, **run, **on)
    monkeypatch.setattr(FailsAfterItsOptimizerStep, "failing_batch", None)
    step = (batch + 1) // ACCUMULATE
    assert torch.load(on_exception.ckpt_path, weights_only=False)["global_step"] == step
    resumed_steps, resumed_losses = StepRecorder(), LossRecorder()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        on = with_dropout_on_the_strategy(StepBoundaryCheckpoint)
        fit(
            tmp_path / "resumed",
            ckpt_path=on_exception.ckpt_path,
            callbacks=[resumed_steps, resumed_losses],
            module_class=FailsAfterItsOptimizerStep,
            **run,
            **on,
        )
    assert not [w for w in caught if "exception interrupted" in str(w.message)]
    assert len(resumed_losses.losses) == len(full_losses.losses) - (batch + 1)
    assert resumed_losses.losses == full_losses.losses[batch + 1 :]
    assert len(resumed_steps.params) == len(full_steps.params) - step
    for resumed, uninterrupted in zip(resumed_steps.params, full_steps.params[step:], strict=True):
        assert resumed.keys() == uninterrupted.keys()
        assert all(torch.equal(resumed[name], uninterrupted[name]) for name in resumed)
    assert resumed_steps.lrs == full_steps.lrs[step:]


class FailsAsTrainingStarts(pl.Callback):
    """Raises in ``on_train_start``, before the checkpoint callbacks' own (Lightning calls them last) and before the
    strategy sets the resumed random states."""

    def on_train_start(self, trainer, pl_module):
        raise Failure("on_train_start")


def test_a_resumed_fit_that_fails_before_training_saves_the_resumed_states_with_a_reused_callback(tmp_path):
    """A ``save_on_exception`` callback that an earlier fit ended at the same global step still held that fit's
    step-end random states, and wrote them into the exception file of a resumed fit failing before
    ``on_train_start``, as at the step's end; without them the file held the generators as the fit found them, not
    yet set to the resumed ones (the strategy sets them in ``on_train_start``). Either way the resumption from that
    file drew other dropout masks than the uninterrupted run."""
    run = {"schedule": {"every_n_train_steps": 4, "save_top_k": -1}, "max_steps": 8, "dropout": 0.5}
    uninterrupted = fit(tmp_path / "full", strategy=LowPrecisionStrategy(), **run)
    on_exception = StepBoundaryCheckpoint(dirpath=tmp_path / "failed", save_top_k=0, save_on_exception=True)
    other_run = {**run, "max_steps": 4, "seed": 7}  # another run, ended at step 4 by this same callback object
    fit(tmp_path / "other", strategy=LowPrecisionStrategy(), callbacks=[on_exception], **other_run)
    assert on_exception._last_global_step_saved == 0  # it saved nothing: the resumed fit's exception is saved
    with pytest.raises(Failure):
        fit(
            tmp_path / "resumed",
            strategy=LowPrecisionStrategy(),
            ckpt_path=tmp_path / "full/epoch=0-step=4.ckpt",
            callbacks=[FailsAsTrainingStarts(), on_exception],
            **run,
        )
    (failed,) = (tmp_path / "failed").glob("*.ckpt")
    assert torch.load(failed, weights_only=False)["global_step"] == 4
    resumed = fit(tmp_path / "again", strategy=LowPrecisionStrategy(), ckpt_path=failed, **run)
    assert torch.equal(resumed, uninterrupted)


@pytest.mark.parametrize(
    ("on_exception", "raised", "amp"),
    [
        ("save_on_exception", Failure, False),  # the closure (training_step, backward) runs inside the step
        ("save_on_exception", KeyboardInterrupt, False),
        ("save_on_exception", Failure, True),  # GradScaler steps it after the closure, without one
        ("OnExceptionCheckpoint", Failure, False),
    ],
)
def test_an_exception_inside_the_optimizers_update_writes_no_file_and_says_which_to_resume_from(
    tmp_path, monkeypatch, fresh_flags, on_exception, raised, amp
):
    """Raised inside ``optimizer.step`` after the update began (a Ctrl-C in a foreach AdamW): the weights are those
    of no step. The exception's file was written as at the last step's end, resumed as exact, and replaced
    ``last.ckpt`` and the step-4 file; Lightning's ``OnExceptionCheckpoint`` (the strategy's) wrote it too. An
    exception in the closure, before the update, still saves (``test_a_file_saved_on_an_exception_resumes_exactly``)."""
    sigint = signal.getsignal(signal.SIGINT)
    monkeypatch.setattr(UpdateRaisesHalfway, "failing_batch", 11)  # step 6's end, epoch 1; step 4 saved
    monkeypatch.setattr(UpdateRaisesHalfway, "raised", raised)
    schedule = {"every_n_train_steps": 4, "save_on_exception": on_exception == "save_on_exception"}
    part = tmp_path / "part"
    lightnings = OnExceptionCheckpoint(tmp_path / "on_exception")
    callbacks = [lightnings] if on_exception == "OnExceptionCheckpoint" else []
    try:
        stops = pytest.raises(Failure if raised is Failure else SystemExit)  # Lightning exits on a Ctrl-C
        with stops, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fit(
                part,
                module_class=UpdateRaisesHalfway,
                schedule=schedule,
                max_steps=8,
                callbacks=callbacks,
                plugins=[AMPPrecision("16-mixed", init_scale=256.0)] if amp else [],
                **with_dropout_on_the_strategy(StepBoundaryCheckpoint),
            )
    finally:
        signal.signal(signal.SIGINT, sigint)
    assert launched_ranks.rank_zero_failed()  # the strategy's on_exception: a rank 0 would stop the ranks it launched
    assert sorted(path.name for path in part.iterdir()) == ["epoch=0-step=4.ckpt", "last.ckpt"]
    assert saved(part / "last.ckpt")[0] == 4
    assert not (tmp_path / "on_exception").exists()
    (said,) = [str(w.message) for w in caught if "inside the optimizer's step" in str(w.message)]
    assert said.startswith(
        f"{on_exception}: {raised.__name__} was raised inside the optimizer's step, after it had begun updating the"
        " parameters, at batch 1 of epoch 1 (global step 5)"
    )
    assert f"The run's last checkpoint stays {part / 'last.ckpt'}; resume from it." in said


class UpdateHooksCounted(pl.Callback):
    """At each of the first two batches' ends: the optimizer's step pre-hooks that follow its updates, and whether
    the guards noted the step's end (batch 1 ends step 1)."""

    def __init__(self) -> None:
        self.hooks: list[int] = []
        self.stepped: list[bool] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        hooks = trainer.optimizers[0]._optimizer_step_pre_hooks.values()
        self.hooks.append(sum(isinstance(getattr(hook, "__self__", None), UpdateWatch) for hook in hooks))
        self.stepped.append(trainer_guard(trainer).watch.stepped)


@pytest.mark.parametrize(
    ("save_on_exception", "lightnings", "hooks"),
    [(False, False, 0), (True, False, 1), (False, True, 1), (True, True, 1)],
)
def test_the_optimizer_is_followed_once_and_only_where_a_callback_saves_on_an_exception(
    tmp_path, save_on_exception, lightnings, hooks
):
    """Each guard hooked the optimizer itself: with ``save_on_exception`` and the strategy's ``OnExceptionCheckpoint``
    each step's closure was wrapped twice, and a run saving nothing on an exception (``StepBoundaryCheckpoint`` is
    the default checkpoint) wrapped it too. The end of each step is still noted (``finish_the_step`` needs it)."""
    counted = UpdateHooksCounted()
    fit(
        tmp_path / "run",
        strategy=LowPrecisionStrategy(),
        schedule={"every_n_train_steps": 4, "save_on_exception": save_on_exception},
        callbacks=[counted, *([OnExceptionCheckpoint(tmp_path / "on_exception")] if lightnings else [])],
        max_steps=1,
    )
    assert counted.hooks == [hooks, hooks]
    assert counted.stepped == [False, True]


class RaisesOneException(pl.Callback):
    """Raises the same exception object at batch 5 of every fit: a later fit's exception where CPython gave it the
    address of an earlier one's."""

    exception = Failure("at batch 5")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.fit_loop.total_batch_idx == 5:
            raise self.exception


def test_the_ranks_are_asked_once_per_failure_whichever_callbacks_save_on_it(tmp_path, monkeypatch):
    """Two callbacks saving on one failure share the ranks' answer (a second ask would wait for them again), and a
    later fit asks again: the answer was kept per process under the exception's ``id`` and the place in the run,
    and a later fit's exception that CPython placed where an earlier one had been took that fit's answer."""
    asked, waits = [], []

    def every_rank_failed(place, update_interrupted, wait_s):
        asked.append(place), waits.append(wait_s)
        return failing_ranks.RanksAtFailure(True, (), wait_s)

    monkeypatch.setattr(failing_ranks, "several_ranks", lambda: True)
    monkeypatch.setattr(failing_ranks, "_ask_the_store", every_rank_failed)
    for run in ("first", "second"):
        with pytest.raises(Failure):
            fit(
                tmp_path / run,
                strategy=LowPrecisionStrategy(),
                schedule={"every_n_train_steps": 4, "save_on_exception": True, "every_rank_wait_s": 300},
                callbacks=[RaisesOneException(), OnExceptionCheckpoint(tmp_path / run)],  # asks first
                max_steps=8,
            )
        assert (tmp_path / run / "on_exception.ckpt").exists()  # both saved on the one answer
        assert saved(tmp_path / run / "last.ckpt")[0] == 2
    assert len(asked) == 2 and asked[0].endswith("0/6/2")
    assert waits == [300.0, 300.0]  # the wait the user gave StepBoundaryCheckpoint, though the other asked first
