"""``Trainer(detect_anomaly=True)`` with fp16 loss scaling: an overflow is skipped by the scaler, as without anomaly
mode, instead of stopping the run at torch's NaN check (``pl_lowprec/plugins/anomaly_mode.py``)."""

import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.plugins import MixedPrecision
from lightning_helpers import quiet_trainer
from resume_helpers import Regression

from pl_lowprec import AMPPrecision, LowPrecisionStrategy

INIT_SCALE = 2.0**20  # the first steps overflow (gradients beyond fp16's 65504) and are skipped, the later ones apply
RUNS = {
    # Real fp16 autocast on the CPU: AMPPrecision, or Lightning's MixedPrecision given the device (its "16-mixed"
    # string is bf16 there).
    "AMPPrecision": (lambda: AMPPrecision("16-mixed", init_scale=INIT_SCALE), lambda: "auto"),
    "MixedPrecision": (
        lambda: MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)),
        LowPrecisionStrategy,  # the package's strategies: any plugin with a scaler
    ),
}


def fit_fp16(run: str, detect_anomaly: bool) -> tuple[torch.Tensor, pl.LightningModule, list[str]]:
    """The weights after 10 steps, the plugin and what was warned."""
    make_plugin, make_strategy = RUNS[run]
    plugin = make_plugin()
    trainer = quiet_trainer(
        strategy=make_strategy(), plugins=[plugin], detect_anomaly=detect_anomaly, max_steps=10, limit_val_batches=0
    )
    model = Regression()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model)
    return model.layer.weight.detach().clone(), plugin, [str(w.message) for w in caught]


@pytest.mark.parametrize("run", RUNS)
def test_an_fp16_overflow_under_detect_anomaly_is_skipped_as_without_it(run):
    """Anomaly mode raised at the first overflow ("Function 'AddmmBackward0' returned nan values"), before the
    scaler could skip it, as under Lightning alone: detect_anomaly could not be used with fp16. The run now equals
    the one without anomaly mode (weights, scale, skipped steps) and says once why the NaN check is off."""
    plain, plain_plugin, _ = fit_fp16(run, detect_anomaly=False)
    anomaly, plugin, said = fit_fp16(run, detect_anomaly=True)
    assert INIT_SCALE / 2**10 < plugin.scaler.get_scale() == plain_plugin.scaler.get_scale() < INIT_SCALE
    if run == "AMPPrecision":
        skipped = plugin.loss_scale_state().skipped_steps
        assert 0 < skipped < 10 and skipped == plain_plugin.loss_scale_state().skipped_steps
    assert torch.equal(anomaly, plain)
    (note,) = [message for message in said if message.startswith("detect_anomaly=True with fp16 loss scaling")]
    assert f"({run} with a GradScaler)" in note and "NaN check off" in note and "'bf16-mixed'" in note
    assert not torch.is_anomaly_enabled() and torch.is_anomaly_check_nan_enabled()  # torch's setting as it was
