"""An accumulation window's micro-batches after two ran alike are counted, not simulated: the estimate is the one
every micro-batch simulated gives, figure for figure, and a window whose micro-batches differ is simulated whole."""

import functools

import pytest
import torch

from pl_lowprec import estimate_memory
from pl_lowprec.demo import TinyLlama
from pl_lowprec.memory import fake_step

WINDOW = 5  # 3 simulated, 2 counted: the count is multiplied, not just added once


TRAINING_STEPS = [0]  # not a class attribute: FSDP2 swaps a sharded module's class for a subclass


class CountedTinyLlama(TinyLlama):
    """Counts its training steps, so a test sees how many micro-batches were simulated."""

    def training_step(self, batch, batch_idx):
        TRAINING_STEPS[0] += 1
        return super().training_step(batch, batch_idx)


class GrowingCache(CountedTinyLlama):
    """Keeps each micro-batch's hidden states: every micro-batch starts with more bytes live than the one before."""

    def configure_model(self):
        super().configure_model()
        self.kept = []

    def training_step(self, batch, batch_idx):
        self.kept.append(torch.ones(batch["input_ids"].shape[0], 64, 64))
        return super().training_step(batch, batch_idx)


def _estimate(module=CountedTinyLlama, **settings):
    build = functools.partial(module, hidden_size=64, intermediate_size=128, num_layers=2, max_len=64)
    TRAINING_STEPS[0] = 0
    estimate = estimate_memory(build, {"input_ids": torch.zeros(2, 64, dtype=torch.long)}, **settings)
    return estimate, TRAINING_STEPS[0]


def _every_micro_batch_simulated(monkeypatch, **settings):
    with monkeypatch.context() as patched:
        patched.setattr(fake_step, "ran_alike", lambda *records: False)
        return _estimate(**settings)


def _figures(estimate):
    ops = estimate.ops
    return (
        estimate.peak,
        estimate.peak_phase,
        estimate.peak_split,
        estimate.timeline,
        estimate.host_peak,
        ops.counts,
        ops.collectives,
        ops.allocated_fresh,
        ops.fresh,
    )


SETTINGS = {
    "full fine-tune fp32": {},
    "lora bf16-mixed, checkpointed, cuda": {
        "lora": {"r": 4},
        "precision": "bf16-mixed",
        "device": "cuda",
        "activation_checkpointing": ["LlamaDecoderLayer"],
    },
    "lora, offloaded activations": {"lora": {"r": 4}, "device": "cuda", "activation_offloading": True},
    "lora, ddp 2 ranks, 8-bit optimizer": {"lora": {"r": 4}, "world_size": 2, "optimizer": "adamw8bit"},
}


@pytest.mark.parametrize("settings", SETTINGS.values(), ids=SETTINGS.keys())
def test_counted_micro_batches_give_the_figures_of_simulating_each(monkeypatch, settings):
    if settings.get("optimizer") == "adamw8bit":
        pytest.importorskip("bitsandbytes")
    every, simulated_every = _every_micro_batch_simulated(monkeypatch, accumulate_grad_batches=WINDOW, **settings)
    counted, simulated = _estimate(accumulate_grad_batches=WINDOW, **settings)
    assert simulated_every == WINDOW and every.repeated_micro_batches == 0
    assert simulated == 3 and counted.repeated_micro_batches == WINDOW - 3
    assert _figures(counted) == _figures(every)
    assert counted.step_time_on("H100") == every.step_time_on("H100")
    assert f"the last {WINDOW - 3} micro-batches of the window counted as the one before" in counted.table()


def test_a_sharded_window_counts_the_same_collectives(monkeypatch):
    pytest.importorskip("torchao")
    from pl_lowprec.distributed.sharding import Sharding

    sharding = {"lora": {"r": 4}, "sharding": Sharding(units=["LlamaDecoderLayer"]), "world_size": 2}
    every, _ = _every_micro_batch_simulated(monkeypatch, accumulate_grad_batches=5, extrapolate=False, **sharding)
    counted, simulated = _estimate(accumulate_grad_batches=5, extrapolate=False, **sharding)
    assert simulated == 3 and counted.ops.collectives
    assert _figures(counted) == _figures(every)


def test_micro_batches_that_differ_are_each_simulated():
    grown, simulated = _estimate(GrowingCache, accumulate_grad_batches=WINDOW)
    assert simulated == WINDOW and grown.repeated_micro_batches == 0
    kept_before_last = (WINDOW - 1) * 2 * 64 * 64 * 4  # fp32 bytes of the earlier micro-batches' kept tensors
    plain, _ = _estimate(accumulate_grad_batches=WINDOW)
    assert grown.peak - plain.peak >= kept_before_last
    assert "micro-batches of the window counted" not in grown.table()


def test_a_short_window_is_simulated_whole():
    for window in (1, 2, 3):
        estimate, simulated = _estimate(accumulate_grad_batches=window)
        assert simulated == window and estimate.repeated_micro_batches == 0
