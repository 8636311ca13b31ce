"""Deep models are estimated from 2 and 3 of their blocks: the same figures as simulating every block."""

import functools

import torch

from pl_lowprec import estimate_memory
from pl_lowprec.demo import TinyLlama


def _estimate(extrapolate: bool, **settings):
    build = functools.partial(TinyLlama, hidden_size=64, intermediate_size=128, num_layers=6, max_len=64)
    batch = {"input_ids": torch.zeros(4, 64, dtype=torch.long)}
    return estimate_memory(build, batch, extrapolate=extrapolate, **settings)


def test_extrapolating_from_two_and_three_blocks_gives_the_full_simulation():
    settings = {"lora": {"r": 4}, "activation_checkpointing": ["LlamaDecoderLayer"]}
    fast, full = _estimate(True, **settings), _estimate(False, **settings)
    assert fast.extrapolated and not full.extrapolated
    assert fast.peak == full.peak and fast.peak_phase == full.peak_phase
    assert fast.timeline == full.timeline
    assert fast.peak_split == full.peak_split
    assert fast.activations == full.activations
    assert fast.weights == full.weights and fast.gradients == full.gradients  # counted on the whole model


def test_blocks_that_differ_are_all_simulated():
    settings = {"lora": {"r": 4}, "activation_checkpointing": ["LlamaDecoderLayer"], "checkpoint_every_n": 2}
    estimate = _estimate(True, **settings)
    assert not estimate.extrapolated
    assert estimate.peak == _estimate(False, **settings).peak
