"""``consecutive_overflows`` counts in one optimizer's own steps, as GradScaler decides found-inf per optimizer
under its one scale: an optimizer that skips every step is stopped for even while another one applies."""

import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning_helpers import TwoOptimizers, mlp_batches, quiet_trainer
from plain_amp_loop import make_mlp

from pl_lowprec import AMPPrecision, LossScaleCollapseError, LossScaleMonitor, PersistentOverflowError
from pl_lowprec.plugins.loss_scale import LossScaleTracker

PLUGINS = {
    # A static scale never collapses: nothing but the monitor can stop a run whose one optimizer never steps.
    "amp_static": lambda: AMPPrecision("16-mixed", loss_scale=1024.0),
    "lightning": lambda: MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**16)),
}


@pytest.mark.parametrize("plugin", PLUGINS.values(), ids=PLUGINS.keys())
def test_one_optimizer_skipping_every_step_stops_the_run_while_the_other_applies(plugin):
    """Counted across optimizers the run read 1, 0, 1, 0 (the other optimizer's applied step reset it): the second
    optimizer never stepped again and max_consecutive_overflows never stopped the run."""
    monitor = LossScaleMonitor(max_consecutive_overflows=3, locate_overflow=False, print_summary=False)
    trainer = quiet_trainer(plugins=[plugin()], max_steps=20, callbacks=[monitor])
    # From batch 1 on, the gradients of the second optimizer's parameters (all but the first) are inf.
    module = TwoOptimizers(make_mlp(), overflow_at_batches=tuple(range(1, 10)), poisoned=slice(1, None))
    with pytest.raises(PersistentOverflowError) as err:
        trainer.fit(module, mlp_batches(10))
    assert trainer.global_step == 8  # batches 0-3: the second optimizer skipped at batches 1, 2 and 3
    assert "3 steps in a row of optimizer 1 (of 2, each counted in its own steps)" in str(err.value)
    assert (monitor._previous.consecutive_overflows, monitor._previous.consecutive_overflows_optimizer) == (3, 1)


def test_a_scale_collapse_names_the_optimizer_that_kept_skipping():
    """AMPPrecision's LossScaleCollapseError counts the run in that optimizer's own steps, with how many there are."""
    plugin = AMPPrecision("16-mixed", init_scale=4.0, min_scale=1.0)
    module = TwoOptimizers(make_mlp(), overflow_at_batches=tuple(range(1, 10)), poisoned=slice(1, None))
    with pytest.raises(LossScaleCollapseError) as err:
        quiet_trainer(plugins=[plugin], max_steps=20).fit(module, mlp_batches(10))
    assert "on 3 steps in a row of optimizer 1 (of 2, each counted in its own steps)" in str(err.value)


def test_both_optimizers_skipping_count_their_own_steps_not_the_sum():
    """Both optimizers overflow on batches 1 and 2: two steps in a row of each, which read 4 counted together
    (a run with two optimizers was stopped after half the batches of a run with one)."""
    plugin = AMPPrecision("16-mixed", init_scale=1024.0)
    trainer = quiet_trainer(plugins=[plugin], max_steps=6, callbacks=[LossScaleMonitor(print_summary=False)])
    consecutive = []

    class Recorded(TwoOptimizers):
        def on_train_batch_end(self, outputs, batch, batch_idx):
            consecutive.append(plugin.loss_scale_state().consecutive_overflows)

    trainer.fit(Recorded(make_mlp(), overflow_at_batches=(1, 2)), mlp_batches(3))
    assert consecutive == [0, 1, 2]
    state = plugin.loss_scale_state()
    assert state.skipped_steps == 4 and state.consecutive_overflows_optimizer == 0


def test_a_checkpoint_keeps_each_optimizers_run_and_reads_an_older_one():
    tracker = LossScaleTracker()
    for skipped, optimizer in [(True, 0), (True, 1), (False, 0), (True, 1)]:
        tracker.record(skipped, optimizer=optimizer)
    restored = LossScaleTracker()
    restored.load_state_dict(tracker.state_dict())
    assert restored.runs == {0: 0, 1: 2} and restored.consecutive_overflows_optimizer == 1
    older = LossScaleTracker()  # saved before the per-optimizer count: one run, taken as optimizer 0's
    older.load_state_dict({"consecutive_overflows": 5, "skipped_steps": 5})
    assert older.consecutive_overflows == 5 and older.consecutive_overflows_optimizer == 0
