"""The fake step runs Lightning's order: the last step's gradients are held from the step start through the first
micro-batch's forward (Lightning's zero_grad runs inside the closure, after training_step, before backward)."""

import functools

import pytest
import torch
from fit_peak_helpers import ids_loader, measured_fit_peak

from pl_lowprec import LowPrecisionStrategy, estimate_memory
from pl_lowprec.demo import TinyLlama

ROWS, SEQ = 2, 32
BUILD = functools.partial(TinyLlama, hidden_size=128, intermediate_size=256, num_layers=2, max_len=SEQ)


def _estimate(**settings):
    return estimate_memory(BUILD, {"input_ids": torch.zeros(ROWS, SEQ, dtype=torch.long)}, device="cpu", **settings)


def test_the_step_starts_with_the_last_steps_gradients():
    estimate = _estimate()
    start = dict(estimate.timeline)["after load"]
    held = ROWS * SEQ * 8 + sum(b.numel() * b.element_size() for b in BUILD().buffers())  # the ids, rotary
    assert start == sum(estimate.weights.values()) + estimate.gradients + estimate.optimizer_state + held


def test_a_full_fine_tune_peaks_in_the_forward_as_measured():
    """Weights, their gradients and AdamW's state (4x the weights) outweigh what backward adds here: the measured
    peak is in the forward, where the last step's gradients are still held."""
    estimate = _estimate(precision="32-true")
    loader = ids_loader(4, ROWS, SEQ)
    measured = measured_fit_peak(BUILD, loader, strategy=LowPrecisionStrategy())
    assert estimate.peak_phase == "forward"
    assert estimate.peak == pytest.approx(measured, rel=0.01), (estimate.peak, measured, estimate.table())


def test_accumulation_frees_the_gradients_once_in_the_window():
    one, four = _estimate(), _estimate(accumulate_grad_batches=4)
    start = dict(one.timeline)["after load"]
    assert dict(four.timeline)["after load"] == start  # the same step start: the last window's gradients
    assert four.peak >= one.peak
