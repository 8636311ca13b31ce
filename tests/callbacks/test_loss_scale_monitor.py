"""LossScaleMonitor: logged series match the plugin, warnings come once, persistent overflow stops and is located."""

import csv

import pytest
import torch
import warm_python
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning_helpers import Classifier, StepRecorder, TwoOptimizers, mlp_batches, quiet_trainer
from plain_amp_loop import make_mlp
from torch import nn

from pl_lowprec import AMPPrecision, LossScaleMonitor, PersistentOverflowError


def _rows(trainer):
    with open(f"{trainer.logger.log_dir}/metrics.csv") as f:
        return [r for r in csv.DictReader(f) if r.get("loss_scale/scale") or r.get("loss_scale/skipped_steps")]


def test_series_in_csv_match_loss_scale_state(tmp_path):
    plugin = AMPPrecision("16-mixed", init_scale=1024.0, growth_interval=3)
    trainer = quiet_trainer(
        plugins=[plugin],
        max_steps=10,
        callbacks=[LossScaleMonitor(window=4)],
        logger=CSVLogger(tmp_path),
        log_every_n_steps=1,
    )
    with pytest.warns(RuntimeWarning, match=r"50% of the last 4 optimizer steps were skipped"):
        trainer.fit(Classifier(make_mlp(), overflow_at_steps=(2, 3)), mlp_batches(10))
    rows = _rows(trainer)
    assert len(rows) == 10
    state = plugin.loss_scale_state()
    last = rows[-1]
    assert float(last["loss_scale/scale"]) == state.scale
    assert float(last["loss_scale/skipped_steps"]) == state.skipped_steps == 2
    assert float(last["loss_scale/overflows"]) == state.overflows
    assert float(last["loss_scale/backoffs"]) == 2
    assert float(last["loss_scale/growths"]) == 2  # after steps 4-6 and 7-9 without overflow
    assert [float(r["loss_scale/scale"]) for r in rows[:5]] == [1024, 1024, 512, 256, 256]
    assert float(rows[3]["loss_scale/skip_rate"]) == 0.5


class Boom(nn.Module):
    """Overflows fp16 in forward: 1e6 is beyond fp16's largest value (65504)."""

    def forward(self, x):
        return x * 1e6


class _GradBoom(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * 1e30


class BackwardBoom(nn.Module):
    """Fine in forward, overflows in backward."""

    def forward(self, x):
        return _GradBoom.apply(x)


@pytest.mark.parametrize(
    ("culprit", "phase", "dtype"), [(Boom, "forward", "float16"), (BackwardBoom, "backward", "float16")]
)
def test_persistent_overflow_stops_and_names_the_module(culprit, phase, dtype):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), culprit(), nn.GELU(), nn.Linear(64, 4))
    monitor = LossScaleMonitor(max_consecutive_overflows=3)
    trainer = quiet_trainer(plugins=[AMPPrecision("16-mixed")], max_steps=10, callbacks=[monitor])
    with pytest.raises(PersistentOverflowError) as err:
        trainer.fit(Classifier(model), mlp_batches(10))
    message = str(err.value)
    assert "3 optimizer steps in a row had inf/NaN gradients and were skipped" in message
    assert f"'model.1' ({dtype}" in message and f"in {phase}" in message
    assert monitor.last_location.module == "model.1" and monitor.last_location.phase == phase
    assert not monitor._locator.armed and not any(m._forward_hooks for m in model.modules())


class InfWhenEvaluating(nn.Module):
    """Non-finite only in validation (eval mode): what a training step's overflow must not be blamed on."""

    def forward(self, x):
        return x if self.training else x * float("inf")


def test_a_validation_pass_after_an_overflow_is_neither_located_nor_checked():
    """Validation between an overflow and the next step ran with the locator's hooks on, and its non-finite output
    was reported as the training step's location ('model.1' in forward, a module training never overflowed in)."""
    hooks_in_validation = []

    class Validated(Classifier):
        def validation_step(self, batch, batch_idx):
            hooks_in_validation.append(sum(len(m._forward_hooks) for m in self.modules()))
            self(batch[0])

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), InfWhenEvaluating(), nn.GELU(), nn.Linear(64, 4))
    monitor = LossScaleMonitor()
    trainer = quiet_trainer(
        plugins=[AMPPrecision("16-mixed")],
        max_steps=4,
        callbacks=[monitor],
        val_check_interval=1,
        limit_val_batches=1,
        num_sanity_val_steps=0,
    )
    trainer.fit(Validated(model, overflow_at_steps=(0, 1, 2)), mlp_batches(10), mlp_batches(1))
    assert trainer.callback_metrics["loss_scale/skipped_steps"] == 3
    assert hooks_in_validation == [0, 0, 0, 0]
    assert monitor.last_location is None  # the poisoned gradients came from no module's forward or backward


def test_no_hooks_on_healthy_steps():
    model = make_mlp()
    monitor = LossScaleMonitor()
    seen_hooks = []

    class Spy(Classifier):
        def training_step(self, batch, batch_idx):
            seen_hooks.append(sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in self.modules()))
            return super().training_step(batch, batch_idx)

    quiet_trainer(plugins=[AMPPrecision("16-mixed")], max_steps=6, callbacks=[monitor]).fit(
        Spy(model, overflow_at_steps=(2,)), mlp_batches(10)
    )
    assert seen_hooks == [0, 0, 0, len(list(model.modules())) * 2, 0, 0]  # armed only on the step after the overflow


def test_lightning_mixed_precision_is_monitored(tmp_path):
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=256.0))
    monitor = LossScaleMonitor()
    trainer = quiet_trainer(
        plugins=[plugin], max_steps=5, callbacks=[monitor], logger=CSVLogger(tmp_path), log_every_n_steps=1
    )
    trainer.fit(Classifier(make_mlp(), overflow_at_steps=(1,)), mlp_batches(10))
    last = _rows(trainer)[-1]
    assert float(last["loss_scale/scale"]) == 128.0
    assert float(last["loss_scale/skipped_steps"]) == 1 and monitor.backoffs == 1


class NaNLoss(Classifier):
    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        return loss * float("nan") if self.global_step in self.overflow_at_steps else loss


def test_bf16_without_scaler_warns_then_stops_and_locates():
    # With no scaler nothing is skipped: one NaN loss poisons the parameters and every later step.
    monitor = LossScaleMonitor(max_consecutive_overflows=3)
    trainer = quiet_trainer(plugins=[AMPPrecision("bf16-mixed")], max_steps=8, callbacks=[monitor])
    with (
        pytest.warns(RuntimeWarning, match=r"non-finite loss or gradient at step 2: with no loss scaler the optimizer"),
        pytest.raises(
            PersistentOverflowError,
            match=r"3 optimizer steps in a row had a non-finite loss or gradients"
            r".*'model.0' \(bfloat16 output in forward\)",
        ) as stopped,
    ):
        trainer.fit(NaNLoss(model := make_mlp(), overflow_at_steps=(1,)), mlp_batches(10))
    # it was "3 steps skipped in all", with bf16 as the advice, to a bf16 run that skipped nothing
    assert "skipped" not in str(stopped.value) and "bf16" not in str(stopped.value)
    assert "and the optimizer applied them" in str(stopped.value)
    assert torch.isnan(model[0].weight).all()  # what the monitor warned about: the update was applied
    assert trainer.callback_metrics["loss_scale/nonfinite_steps"] == 2  # logged before the third stopped the run
    assert trainer.callback_metrics["loss_scale/skipped_steps"] == 0


def test_scale_warning_comes_once_and_works_without_logger(recwarn):
    plugin = AMPPrecision("16-mixed", init_scale=4.0, min_scale=None)
    monitor = LossScaleMonitor(warn_scale_below=2.0, max_consecutive_overflows=None)
    trainer = quiet_trainer(plugins=[plugin], max_steps=6, callbacks=[monitor], logger=False)
    trainer.fit(Classifier(make_mlp(), overflow_at_steps=(1, 2, 3)), mlp_batches(10))
    scale_warnings = [w for w in recwarn if "The loss scale fell to" in str(w.message)]
    assert len(scale_warnings) == 1 and "fell to 1 (below 2)" in str(scale_warnings[0].message)
    assert trainer.callback_metrics["loss_scale/skipped_steps"] == 3


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"window": 0}, "window=0"),
        ({"warn_skip_rate": 2.0}, "warn_skip_rate=2.0"),
        ({"max_consecutive_overflows": 0}, "max_consecutive_overflows=0"),
    ],
)
def test_bad_arguments(kwargs, named):
    with pytest.raises(ValueError, match=named):
        LossScaleMonitor(**kwargs)


def test_a_backward_overflow_at_the_head_is_named_not_the_first_layer():
    """A loss 1e8 times too large overflows fp16 in backward at the output head. The locator told "the same
    gradient" by ``id(grad)``; CPython gives a freed gradient's id to the next one, so each earlier module took
    the location over, down to the first layer ('blocks.0.norm1')."""
    from pl_lowprec.demo.tiny_gpt import TinyGPT

    class LargeLoss(TinyGPT):
        def training_step(self, batch, batch_idx):
            loss = super().training_step(batch, batch_idx)
            return loss * 1e8 if self.trainer.global_step in (2, 3) else loss

    torch.manual_seed(0)
    model = LargeLoss(dim=32, layers=1, heads=2, max_len=32, warmup_steps=1)
    ids = torch.randint(0, 256, (16, 33), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader([{"input_ids": r} for r in ids], batch_size=4)
    monitor = LossScaleMonitor(window=4)
    trainer = quiet_trainer(plugins=[AMPPrecision("16-mixed", init_scale=1024.0)], max_steps=4, callbacks=[monitor])
    trainer.fit(model, loader)
    assert str(monitor.last_location) == "'head' (float32 input gradient in backward)"


def test_lightning_mixed_precision_counts_an_overflow_on_the_first_step(tmp_path):
    """The first step had no scale before it to compare with, and its skip went uncounted."""
    plugin = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=256.0))
    monitor = LossScaleMonitor()
    trainer = quiet_trainer(plugins=[plugin], max_steps=5, callbacks=[monitor], logger=False)
    trainer.fit(Classifier(make_mlp(), overflow_at_steps=(0, 3)), mlp_batches(10))
    assert trainer.callback_metrics["loss_scale/skipped_steps"] == 2 and monitor.backoffs == 2


def test_counts_go_on_where_a_resumed_run_starts(tmp_path):
    """growths, back-offs, the skip-rate window and the warnings given restarted at zero after a resume: the
    resumed run said "2 of 8 skipped; 1 back-offs" where the uninterrupted one said 2."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def run(steps, ckpt_path=None, **kwargs):
        monitor = LossScaleMonitor(window=4)
        trainer = quiet_trainer(
            plugins=[AMPPrecision("16-mixed", init_scale=1024.0, growth_interval=3)],
            max_steps=steps,
            callbacks=[monitor, *kwargs.pop("callbacks", [])],
            default_root_dir=tmp_path,
            **kwargs,
        )
        trainer.fit(Classifier(make_mlp(), overflow_at_steps=(1, 5)), mlp_batches(10), ckpt_path=ckpt_path)
        return monitor

    whole = run(8, logger=False)
    saver = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=4, save_top_k=-1)
    run(4, logger=False, callbacks=[saver], enable_checkpointing=True)
    resumed = run(8, ckpt_path=tmp_path / "ckpt" / "epoch=0-step=4.ckpt", logger=False)
    assert (resumed.backoffs, resumed.growths, list(resumed._recent)) == (
        whole.backoffs,
        whole.growths,
        list(whole._recent),
    )
    assert whole.backoffs == 2


def test_the_final_counts_reach_the_logger_whatever_log_every_n_steps(tmp_path):
    """Lightning passes self.log's values on only every log_every_n_steps-th step: with 50 and 6 steps the logger
    got no loss_scale value at all, while the summary line counted the skip."""
    plugin = AMPPrecision("16-mixed", init_scale=1024.0)
    trainer = quiet_trainer(
        plugins=[plugin], max_steps=6, callbacks=[LossScaleMonitor()], logger=CSVLogger(tmp_path), log_every_n_steps=50
    )
    trainer.fit(Classifier(make_mlp(), overflow_at_steps=(4,)), mlp_batches(10))
    with open(f"{trainer.logger.log_dir}/metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("loss_scale/final/skipped_steps")]
    assert len(rows) == 1 and float(rows[0]["loss_scale/final/skipped_steps"]) == 1
    assert float(rows[0]["loss_scale/final/scale"]) == plugin.loss_scale_state().scale == 512


def _gather_on_two_ranks(rank, path):
    import torch.distributed as dist

    from pl_lowprec.callbacks.loss_scale_monitor import first_location_of_all_ranks
    from pl_lowprec.callbacks.overflow_locator import OverflowLocation

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    seen = OverflowLocation("blocks.0.mlp.0", "forward", torch.float16) if rank == 1 else None
    found = first_location_of_all_ranks(seen, rank)
    dist.destroy_process_group()
    assert str(found) == "'blocks.0.mlp.0' (float16 output in forward) on rank 1"


def test_a_location_only_another_rank_saw_is_the_one_reported(tmp_path):
    """Only rank zero warns, and an activation's inf stays on the rank whose batch made it: rank 1's find was lost."""
    warm_python.spawn(_gather_on_two_ranks, args=(str(tmp_path / "rendezvous"),), nprocs=2)


def test_without_a_logger_it_says_where_its_numbers_go(monkeypatch):
    """Under logger=False the per-step series went nowhere, and nothing said so."""
    said = []
    monkeypatch.setattr("pl_lowprec.callbacks.loss_scale_monitor.rank_zero_info", said.append)
    trainer = quiet_trainer(plugins=[AMPPrecision("16-mixed")], max_steps=2, callbacks=[LossScaleMonitor()])
    trainer.fit(Classifier(make_mlp()), mlp_batches(2))
    assert len(said) == 1 and "no logger (logger=False), so the loss_scale/* series is not recorded" in said[0]
    assert "trainer.callback_metrics holds the latest values and the summary line" in said[0]
    assert trainer.callback_metrics["loss_scale/skipped_steps"] == 0


@pytest.mark.parametrize(
    ("plugin", "scale", "backoffs"),
    [
        (lambda: MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=1024.0)), 256.0, 2),
        (lambda: AMPPrecision("16-mixed", init_scale=1024.0), 512.0, 1),  # one scale update per training_step
    ],
    ids=["lightning", "amp"],
)
def test_both_skips_of_a_batch_with_two_optimizers_are_counted(plugin, scale, backoffs):
    """Lightning's plugin updates the scale after each optimizer's step: both skipped and the scale fell 4x, but
    the monitor, which infers its skips from a falling scale, counted one skip and one back-off."""
    plugin = plugin()
    monitor = LossScaleMonitor(print_summary=False)
    trainer = quiet_trainer(plugins=[plugin], max_steps=6, callbacks=[monitor])
    trainer.fit(TwoOptimizers(make_mlp(), overflow_at_batches=(1,)), mlp_batches(3))
    assert plugin.scaler.get_scale() == scale
    assert trainer.callback_metrics["loss_scale/skipped_steps"] == 2 and monitor.backoffs == backoffs
    assert list(monitor._recent) == [False, False, True, True, False, False]


class ReturnsNone(Classifier):
    def training_step(self, batch, batch_idx):
        return None if batch_idx in (1, 2) else super().training_step(batch, batch_idx)


@pytest.mark.parametrize(
    "plugin",
    [lambda: AMPPrecision("16-mixed"), lambda: MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))],
    ids=["amp", "lightning"],
)
def test_steps_that_applied_nothing_are_not_counted_as_optimizer_steps(capsys, plugin):
    """Two training_steps returned None, so nothing was unscaled or applied (AMPPrecision counts no step, Lightning's
    plugin calls no scaler.step), but the summary said "0 of 6 optimizer steps skipped", as if all six had trained."""
    plugin = plugin()
    trainer = quiet_trainer(plugins=[plugin], max_steps=6, callbacks=[LossScaleMonitor()])
    trainer.fit(ReturnsNone(make_mlp()), mlp_batches(10))
    assert trainer.global_step == 6
    assert not isinstance(plugin, AMPPrecision) or plugin.loss_scale_state().optimizer_steps == 4
    assert (
        "Loss scale: 65536 at the end; 0 of 4 optimizer steps skipped for overflow; 0 growths, 0 back-offs."
        " 2 more steps applied nothing (training_step returned None)." in capsys.readouterr().out
    )


def test_lightning_fp16_mixed_precision_on_several_ranks_is_named_as_unable_to_agree():
    """Lightning's MixedPrecision lets one rank skip a step the others apply (its GradScaler reduces nothing): the
    monitor's numbers are then rank zero's and its location gather can wait for ever, and nothing said so."""
    from types import SimpleNamespace

    from lightning.pytorch.plugins.precision import FSDPPrecision

    from pl_lowprec.callbacks.loss_scale_monitor import ranks_may_disagree_on_overflow

    def trainer(plugin, world_size=2):
        return SimpleNamespace(
            precision_plugin=plugin, world_size=world_size, loggers=["a logger"], global_step=0, optimizers=[]
        )

    lightning_fp16 = MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))
    assert ranks_may_disagree_on_overflow(trainer(lightning_fp16))
    assert not ranks_may_disagree_on_overflow(trainer(lightning_fp16, world_size=1))
    assert not ranks_may_disagree_on_overflow(trainer(AMPPrecision("16-mixed")))  # all-reduces its found-inf
    assert not ranks_may_disagree_on_overflow(trainer(MixedPrecision("bf16-mixed", "cpu")))  # no scaler
    assert not ranks_may_disagree_on_overflow(trainer(FSDPPrecision("16-mixed")))  # ShardedGradScaler agrees
    with pytest.warns(RuntimeWarning, match=r"decides on each of the 2 processes alone.*AMPPrecision\('16-mixed'\)"):
        LossScaleMonitor().on_train_start(trainer(lightning_fp16), None)


def test_a_growth_and_a_skip_in_one_batch_are_both_counted_under_lightnings_plugin():
    """Lightning's plugin updates the scale after each optimizer's step: with growth_interval=1 the first optimizer's
    clean step doubled the scale and the second one's overflow halved it, so the scale read unchanged and the monitor,
    inferring skips from a falling scale, said "0 of 6 optimizer steps skipped; 2 growths, 0 back-offs"."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    monitor = LossScaleMonitor(locate_overflow=False, print_summary=False)
    plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    trainer = quiet_trainer(plugins=[plugin], max_steps=6, callbacks=[monitor])
    second_overflows_at_batch_1 = TwoOptimizers(make_mlp(), overflow_at_batches=(1,), poisoned=slice(1, None))
    trainer.fit(second_overflows_at_batch_1, mlp_batches(3))
    assert scaler.get_scale() == 1024.0 * 2**5 * 0.5  # five clean updates, one overflow
    assert trainer.callback_metrics["loss_scale/skipped_steps"] == 1
    assert (monitor.growths, monitor.backoffs) == (5, 1)
    assert list(monitor._recent) == [False, False, False, True, False, False]
    assert monitor._previous.optimizer_steps == 6 and monitor.empty_steps == 0


def test_a_fused_optimizers_skipped_step_is_counted_under_lightnings_plugin():
    """GradScaler calls a fused optimizer's step() even on an overflow (its kernel reads ``optimizer.found_inf`` and
    skips the update), so its step post-hook fires: the monitor counted the skipped step as applied and read
    "0 of 4 optimizer steps skipped" while the parameters stood still."""
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    monitor = LossScaleMonitor(locate_overflow=False, print_summary=False)
    recorder = StepRecorder()
    plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    trainer = quiet_trainer(plugins=[plugin], max_steps=4, callbacks=[monitor, recorder])
    module = Classifier(make_mlp(), overflow_at_steps=(1,), optimizer_kwargs={"fused": True})
    trainer.fit(module, mlp_batches(4))
    assert trainer.optimizers[0].defaults["fused"]
    assert all(torch.equal(recorder.params[1][k], recorder.params[2][k]) for k in recorder.params[1])  # skipped
    assert not torch.equal(recorder.params[2]["model.0.weight"], recorder.params[3]["model.0.weight"])  # applied
    assert scaler.get_scale() == 512.0
    assert trainer.callback_metrics["loss_scale/skipped_steps"] == 1
    assert list(monitor._recent) == [False, True, False, False]
    assert (monitor.growths, monitor.backoffs) == (0, 1)
