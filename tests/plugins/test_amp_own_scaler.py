"""A scaler of the user's (``scaler=``, or assigned to ``plugin.scaler``) is the one every step goes through."""

import gc
import logging
import weakref

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from pl_lowprec import AMPPrecision
from pl_lowprec.plugins import lightning_messages
from pl_lowprec.plugins.lightning_messages import ADVICE


class CountingScaler(torch.amp.GradScaler):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = {"unscale_": 0, "step": 0, "update": 0}

    def unscale_(self, optimizer):
        self.calls["unscale_"] += 1
        return super().unscale_(optimizer)

    def step(self, optimizer, *args, **kwargs):
        self.calls["step"] += 1
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale=None):
        self.calls["update"] += 1
        return super().update(new_scale)


def _fit(plugin, steps=3):
    trainer = Trainer(accelerator="cpu", plugins=[plugin], barebones=True, max_steps=steps, gradient_clip_val=1.0)
    trainer.fit(BoringModel())
    return trainer


@pytest.mark.parametrize("how", ["argument", "assigned"])
def test_a_users_grad_scaler_subclass_drives_every_step(how):
    scaler = CountingScaler("cpu", init_scale=2.0**10)
    if how == "argument":
        plugin = AMPPrecision("16-mixed", scaler=scaler)
    else:
        plugin = AMPPrecision("16-mixed")
        plugin.scaler = scaler
    _fit(plugin)
    assert scaler.calls == {"unscale_": 3, "step": 3, "update": 3}
    assert plugin.loss_scale_state().skipped_steps == 0


def test_a_scaler_with_bf16_or_loss_scale_settings_is_refused():
    with pytest.raises(ValueError, match=r"precision='bf16-mixed'.*fp16 only.*Pass precision='16-mixed'"):
        AMPPrecision("bf16-mixed", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match=r"precision='auto'"):
        AMPPrecision("auto", scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match=r"init_scale=1024.0\): the scaler you pass carries its own settings"):
        AMPPrecision("16-mixed", init_scale=1024.0, scaler=torch.amp.GradScaler("cpu"))


def test_lightnings_fp32_matmul_advice_is_held_back_while_the_plugin_lives(caplog, monkeypatch):
    monkeypatch.setattr(lightning_messages, "_plugins", weakref.WeakSet())  # other tests' plugins may still live

    def advise():
        rank_zero_info(f"You are using a CUDA device ('X') that has Tensor Cores. {ADVICE}('medium' | 'high')`")

    caplog.set_level(logging.INFO)
    plugin = AMPPrecision("bf16-mixed")
    advise()
    assert ADVICE not in caplog.text  # under autocast the matmuls are already half precision
    del plugin
    gc.collect()
    advise()
    assert ADVICE in caplog.text  # a process without AMPPrecision still gets Lightning's advice
