"""``Trainer(detect_anomaly=True)`` with fp16 loss scaling: an overflow is skipped by the scaler, as without anomaly
mode, instead of stopping the run at torch's NaN check (``pl_lowprec/plugins/anomaly_mode.py``)."""

import warnings

import lightning.pytorch as pl
import torch
from resume_helpers import Regression

from pl_lowprec import AMPPrecision


def fit_fp16(detect_anomaly: bool) -> tuple[torch.Tensor, AMPPrecision, list[str]]:
    """Real fp16 autocast on the CPU (``AMPPrecision``, not Lightning's "16-mixed", which is bf16 there), from a
    scale of 2**20: the first steps overflow (gradients beyond fp16's 65504) and are skipped, the later ones apply.
    The weights, the plugin and what was warned."""
    plugin = AMPPrecision("16-mixed", init_scale=2.0**20)
    trainer = pl.Trainer(
        accelerator="cpu",
        plugins=[plugin],
        detect_anomaly=detect_anomaly,
        max_steps=10,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    model = Regression()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model)
    return model.layer.weight.detach().clone(), plugin, [str(w.message) for w in caught]


def test_an_fp16_overflow_under_detect_anomaly_is_skipped_as_without_it():
    """Anomaly mode raised at the first overflow ("Function 'AddmmBackward0' returned nan values"), before the
    scaler could skip it, as under Lightning alone: detect_anomaly could not be used with fp16. The run now equals
    the one without anomaly mode (weights, scale, skipped steps) and says once why the NaN check is off."""
    plain, plain_plugin, _ = fit_fp16(detect_anomaly=False)
    anomaly, plugin, said = fit_fp16(detect_anomaly=True)
    skipped = plugin.loss_scale_state().skipped_steps
    assert 0 < skipped < 10 and skipped == plain_plugin.loss_scale_state().skipped_steps
    assert plugin.scaler.get_scale() == plain_plugin.scaler.get_scale()
    assert torch.equal(anomaly, plain)
    (note,) = [message for message in said if message.startswith("detect_anomaly=True with fp16 loss scaling")]
    assert "NaN check off" in note and "LossScaleMonitor" in note and "'bf16-mixed'" in note
    assert not torch.is_anomaly_enabled() and torch.is_anomaly_check_nan_enabled()  # torch's setting as it was
