"""Scaler state and step counters survive checkpoints; Lightning's own fp16 checkpoints load; this run's
loss-scale settings apply on resume."""

import warnings

import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning_helpers import Classifier, quiet_trainer
from plain_amp_loop import make_classification_data, make_mlp

from pl_lowprec import AMPPrecision

STEPS_PER_EPOCH = 4


def _loader():
    return torch.utils.data.DataLoader(make_classification_data(n=STEPS_PER_EPOCH * 8), batch_size=8)


def _plugin():
    return AMPPrecision("16-mixed", init_scale=1024.0, growth_interval=3)


def _module():
    return Classifier(make_mlp(), scheduler=True, overflow_at_steps=(1,))


def test_resume_matches_uninterrupted_run(tmp_path):
    straight_plugin, straight = _plugin(), _module()
    quiet_trainer(plugins=[straight_plugin], max_epochs=2).fit(straight, _loader())

    first = quiet_trainer(plugins=[_plugin()], max_epochs=1)
    first.fit(_module(), _loader())
    ckpt = tmp_path / "mid.ckpt"
    first.save_checkpoint(ckpt)
    assert torch.load(ckpt, weights_only=False)["AMPPrecision"]["tracker"]["skipped_steps"] == 1

    resumed_plugin, resumed = _plugin(), _module()
    trainer = quiet_trainer(plugins=[resumed_plugin], max_epochs=2)
    trainer.fit(resumed, _loader(), ckpt_path=ckpt)

    assert resumed_plugin.loss_scale_state() == straight_plugin.loss_scale_state()
    # backed off to 512 at step 1, grew at steps 4 and 7: needs the growth tracker restored mid-interval
    assert resumed_plugin.loss_scale_state().scale == 2048.0
    assert trainer.optimizers[0].param_groups[0]["lr"] == straight.trainer.optimizers[0].param_groups[0]["lr"]
    for ours, theirs in zip(resumed.parameters(), straight.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("settings", "scale", "tracker"),
    [
        # saved: scale 512, 2 overflow-free steps. 2 more reach growth_interval=4: x8 at step 5, then 2 clean steps
        (dict(growth_interval=4, growth_factor=8.0, backoff_factor=0.25), 4096.0, 2),
        # growth_interval=2 is already reached: the next clean step grows (GradScaler grows only at the interval
        # exactly, so the saved tracker as it is would never let it grow), at steps 4 and 6
        (dict(growth_interval=2), 2048.0, 1),
    ],
    ids=["interval_factor_backoff", "interval_already_reached"],
)
def test_resume_with_changed_settings_runs_with_them_and_says_so(tmp_path, settings, scale, tracker):
    first = quiet_trainer(plugins=[_plugin()], max_epochs=1)
    first.fit(_module(), _loader())
    ckpt = tmp_path / "mid.ckpt"
    first.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)["AMPPrecision"]["scaler"]
    assert (saved["scale"], saved["_growth_tracker"], saved["growth_interval"]) == (512.0, 2, 3)

    plugin = AMPPrecision("16-mixed", init_scale=1024.0, **settings)
    trainer = quiet_trainer(plugins=[plugin], max_epochs=2)
    with pytest.warns(UserWarning, match="loss-scale settings other than the checkpoint's") as record:
        trainer.fit(_module(), _loader(), ckpt_path=ckpt)

    (message,) = [str(w.message) for w in record if "checkpoint's" in str(w.message)]
    for name, value in settings.items():
        assert f"{name}={value!r} (checkpoint: {saved[name]!r})" in message
        assert f"{name}={saved[name]!r}" in message.split("pass AMPPrecision(")[1]  # how to keep the old one
    assert "the scale (512)" in message
    assert plugin.scaler.get_growth_interval() == settings["growth_interval"]
    assert plugin.scaler.get_growth_factor() == settings.get("growth_factor", 2.0)
    assert plugin.scaler.get_backoff_factor() == settings.get("backoff_factor", 0.5)
    assert plugin.loss_scale_state().scale == scale
    assert plugin.scaler.state_dict()["_growth_tracker"] == tracker
    assert plugin.loss_scale_state().skipped_steps == 1  # the counters resumed too


def test_loads_checkpoint_from_lightning_mixed_precision(tmp_path):
    scaler = torch.amp.GradScaler("cpu", init_scale=512.0, growth_interval=7)
    lightning_trainer = quiet_trainer(plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)], max_epochs=1)
    lightning_trainer.fit(Classifier(make_mlp()), _loader())
    ckpt = tmp_path / "lightning.ckpt"
    lightning_trainer.save_checkpoint(ckpt)

    plugin = AMPPrecision("16-mixed", growth_interval=7)  # the same settings: nothing to warn about
    trainer = quiet_trainer(plugins=[plugin], max_epochs=2)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*loss-scale settings")
        trainer.fit(Classifier(make_mlp()), _loader(), ckpt_path=ckpt)
    assert plugin.scaler.get_growth_interval() == 7
    assert plugin.loss_scale_state().scale == 1024.0  # 512 restored, grown once after 7 clean steps
    assert trainer.global_step == 2 * STEPS_PER_EPOCH
