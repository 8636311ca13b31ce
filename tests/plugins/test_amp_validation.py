"""Bad input fails before the first step, naming the bad value and the fix."""

from unittest import mock

import pytest
import torch
from lightning_helpers import Classifier, quiet_trainer
from plain_amp_loop import make_classification_data, make_mlp
from torch import nn

from pl_lowprec import AMPPrecision


def _loader():
    return torch.utils.data.DataLoader(make_classification_data(n=32), batch_size=8)


@pytest.mark.parametrize(
    ("bad", "meant"),
    [("fp16", "16-mixed"), ("16", "16-mixed"), ("bf16", "bf16-mixed"), ("AUTO", "auto"), ("32-true", None)],
)
def test_unknown_precision_lists_allowed_and_names_the_one_meant(bad, meant):
    """Lightning's Trainer takes "16" and "bf16" (legacy names of the mixed precisions): the plugin names them."""
    with pytest.raises(ValueError, match=rf"precision='{bad}'.*'16-mixed'.*'bf16-mixed'") as refused:
        AMPPrecision(bad)
    assert (f"Did you mean '{meant}'?" in str(refused.value)) if meant else "Did you mean" not in str(refused.value)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"loss_scale": "dynamic"}, "loss_scale='dynamic'"),
        ({"loss_scale": 128.0}, "loss_scale=128.0"),
        ({"init_scale": 1024.0}, "init_scale=1024.0"),
        ({"growth_interval": 10}, "growth_interval=10"),
    ],
)
def test_loss_scale_settings_with_bf16_are_refused(kwargs, named):
    with pytest.raises(ValueError, match=rf"{named}.*fp16 only.*use '16-mixed'"):
        AMPPrecision("bf16-mixed", **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"loss_scale": "static"}, "loss_scale='static'"),
        ({"loss_scale": -4.0}, "loss_scale=-4.0"),
        ({"loss_scale": float("inf")}, "loss_scale=inf"),
        ({"growth_factor": 1.0}, "growth_factor=1.0 must be > 1.0"),
        ({"backoff_factor": 1.5}, "backoff_factor=1.5 must be between 0 and 1"),
        ({"growth_interval": 0}, "growth_interval=0 must be an integer"),
        ({"init_scale": 0.0}, "init_scale=0.0 must be finite"),
        ({"min_scale": 1e6}, r"min_scale=1000000.0 must be > 0 and <= init_scale"),
        ({"loss_scale": 64.0, "growth_interval": 5}, "apply to loss_scale='dynamic' only"),
    ],
)
def test_bad_scaling_arguments_are_named(kwargs, named):
    with pytest.raises(ValueError, match=named):
        AMPPrecision("16-mixed", **kwargs)


def test_a_bad_init_scale_is_one_problem_not_two():
    """init_scale=0 was also told as 'min_scale ... must be <= init_scale (0.0)', a consequence, not a second fault."""
    with pytest.raises(ValueError) as refused:
        AMPPrecision("16-mixed", init_scale=0.0, min_scale=1.0)
    assert "init_scale=0.0 must be finite and > 0" in str(refused.value) and "min_scale" not in str(refused.value)


def test_bf16_on_cuda_without_bf16_names_the_gpu_and_fp16():
    plugin = AMPPrecision("bf16-mixed", device="cuda")
    with (
        mock.patch("torch.cuda.is_bf16_supported", return_value=False),
        mock.patch("torch.cuda.get_device_name", return_value="Tesla T4"),
        pytest.raises(ValueError, match=r"'Tesla T4' has no bf16 support.*AMPPrecision\('16-mixed'\)"),
    ):
        plugin.convert_module(nn.Linear(2, 2))


def _half_first_layer():
    model = make_mlp()
    model[0].half()
    return model


def test_fp16_trainable_parameters_are_named_before_training():
    model = _half_first_layer()
    before = model[0].weight.detach().clone()
    trainer = quiet_trainer(plugins=[AMPPrecision("16-mixed")], max_steps=2)
    with pytest.raises(
        ValueError,
        match=r"2 trainable parameters stored in fp16: model.0.weight, model.0.bias"
        r".*upcast_trainable=True",
    ):
        trainer.fit(Classifier(model), _loader())
    assert trainer.global_step == 0
    assert torch.equal(model[0].weight, before)


def test_upcast_trainable_casts_and_says_so():
    model = _half_first_layer()
    with pytest.warns(UserWarning, match=r"cast 2 trainable fp16 parameters to fp32.*model.0.weight"):
        quiet_trainer(plugins=[AMPPrecision("16-mixed", upcast_trainable=True)], max_steps=2).fit(
            Classifier(model), _loader()
        )
    assert model[0].weight.dtype == torch.float32


def test_frozen_fp16_parameters_are_fine():
    model = _half_first_layer()
    model[0].requires_grad_(False)  # frozen fp16 weights (a quantized or half base model) need no unscaling
    trainer = quiet_trainer(plugins=[AMPPrecision("16-mixed")], max_steps=2)
    trainer.fit(Classifier(model), _loader())
    assert trainer.global_step == 2


def test_fused_optimizer_fails_with_a_fix():
    module = Classifier(make_mlp(), optimizer_kwargs={"fused": True})
    with pytest.raises(ValueError, match=r"AdamW\(fused=True\).*fused=False"):
        quiet_trainer(plugins=[AMPPrecision("16-mixed")], max_steps=2).fit(module, _loader())


def test_foreach_optimizer_works():
    module = Classifier(make_mlp(), optimizer_kwargs={"foreach": True})
    trainer = quiet_trainer(plugins=[AMPPrecision("16-mixed")], max_steps=2)
    trainer.fit(module, _loader())
    assert trainer.global_step == 2
