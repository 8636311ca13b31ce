"""Overflowing steps: skipped honestly, with parameters, optimizer state and LR schedule untouched."""

import pytest
import torch
from lightning_helpers import Classifier, StepRecorder, quiet_trainer
from plain_amp_loop import make_classification_data, make_mlp

from pl_lowprec import AMPPrecision, LossScaleCollapseError, SkipAwareScheduler


def _loader(steps: int, accumulate: int = 1, batch: int = 8):
    data = make_classification_data(n=steps * accumulate * batch)
    return torch.utils.data.DataLoader(data, batch_size=batch)


def _fit(plugin, steps, accumulate=1, overflow_at=(), scheduler=True, **trainer_kwargs):
    recorder = StepRecorder()
    module = Classifier(make_mlp(), scheduler=scheduler, overflow_at_steps=overflow_at)
    trainer = quiet_trainer(
        plugins=[plugin],
        max_steps=steps,
        accumulate_grad_batches=accumulate,
        callbacks=[recorder],
        **trainer_kwargs,
    )
    trainer.fit(module, _loader(steps, accumulate))
    return trainer, recorder


def _assert_same_optimizer_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        for name in a[key]:
            torch.testing.assert_close(a[key][name], b[key][name], rtol=0, atol=0)


@pytest.mark.parametrize("accumulate", [1, 3])
def test_overflow_skips_step_and_scheduler_then_recovers(accumulate):
    plugin = AMPPrecision("16-mixed")
    trainer, rec = _fit(plugin, steps=6, accumulate=accumulate, overflow_at=(3,))

    # step index 3 (the 4th optimizer step) was skipped: state after it equals state before it
    for name in rec.params[3]:
        torch.testing.assert_close(rec.params[4][name], rec.params[3][name], rtol=0, atol=0)
    _assert_same_optimizer_state(rec.optim_states[4], rec.optim_states[3])
    assert rec.lrs[4] == rec.lrs[3]
    # every other step changed parameters and LR
    for k in (1, 2, 3, 5, 6):
        assert not torch.equal(rec.params[k]["model.0.weight"], rec.params[k - 1]["model.0.weight"])
        assert rec.lrs[k] == pytest.approx(rec.lrs[k - 1] * 0.9)
    # the schedule lags by exactly the one skipped step
    assert rec.lrs[-1] == pytest.approx(1e-2 * 0.9**5)

    state = plugin.loss_scale_state()
    assert state.scale == 2.0**15
    assert state.overflows == state.skipped_steps == 1  # a whole accumulation window counts once
    assert state.consecutive_overflows == 0 and not state.last_step_skipped
    assert trainer.global_step == 6  # the skipped step is counted
    assert isinstance(trainer.lr_scheduler_configs[0].scheduler, SkipAwareScheduler)


def test_scheduler_steps_on_overflow_when_asked():
    plugin = AMPPrecision("16-mixed", skip_scheduler_on_overflow=False)
    _, rec = _fit(plugin, steps=4, overflow_at=(1,))
    assert rec.lrs[2] == pytest.approx(rec.lrs[1] * 0.9)  # Lightning's behaviour: schedule runs ahead


def test_state_reports_a_skipped_last_step():
    plugin = AMPPrecision("16-mixed", init_scale=1024.0)
    _fit(plugin, steps=3, overflow_at=(1, 2))
    state = plugin.loss_scale_state()
    assert state.scale == 256.0
    assert (state.overflows, state.skipped_steps, state.consecutive_overflows) == (2, 2, 2)
    assert state.last_step_skipped


def test_growth_after_interval():
    plugin = AMPPrecision("16-mixed", init_scale=8.0, growth_interval=2, min_scale=None)
    _fit(plugin, steps=4)
    assert plugin.loss_scale_state().scale == 32.0


def test_static_scale_skips_but_keeps_scale():
    plugin = AMPPrecision("16-mixed", loss_scale=128.0)
    _, rec = _fit(plugin, steps=4, overflow_at=(2,))
    state = plugin.loss_scale_state()
    assert state.scale == 128.0 and state.skipped_steps == 1
    torch.testing.assert_close(rec.params[3]["model.0.weight"], rec.params[2]["model.0.weight"], rtol=0, atol=0)


def test_collapse_below_min_scale_stops_with_history():
    plugin = AMPPrecision("16-mixed", init_scale=16.0, min_scale=2.0)
    with pytest.raises(LossScaleCollapseError) as err:
        _fit(plugin, steps=10, overflow_at=tuple(range(10)))
    msg = str(err.value)
    assert "fell to 1, below min_scale=2" in msg
    assert "4 optimizer steps in a row" in msg
    assert "step 1 -> 8, step 2 -> 4, step 3 -> 2, step 4 -> 1" in msg
    assert "bf16-mixed" in msg  # offers a fix


def test_bf16_has_no_scaler_and_reports_scale_one():
    plugin = AMPPrecision("bf16-mixed")
    trainer, _ = _fit(plugin, steps=2)
    assert plugin.scaler is None and trainer.scaler is None
    assert plugin.loss_scale_state().scale == 1.0
    assert plugin.compute_dtype == torch.bfloat16
