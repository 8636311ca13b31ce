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


def test_a_phase_that_overtakes_the_peak_between_four_blocks_and_the_real_depth_is_extrapolated_on_its_line(tmp_path):
    """SmolLM2's shape, full fine-tune, 8 blocks: at 2-4 blocks the backward peaks (the tied embedding's gradient),
    at 8 the forward does (it holds the last step's gradients, which grow with every block); extrapolating the
    backward's line gave the backward's peak, 2.5% under the forward's (the measured one). The forward's own line
    (its peak and split at 2-4 blocks) gives the full simulation's figures, without simulating every block."""
    import json

    from model_shapes import SMOLLM2_135M

    from pl_lowprec.models import CausalLM

    (tmp_path / "config.json").write_text(json.dumps({**SMOLLM2_135M, "num_hidden_layers": 8}))
    build = functools.partial(CausalLM, pretrained=str(tmp_path), loss_chunk_size="auto")
    ids = torch.zeros(4, 256, dtype=torch.long)
    estimates = [
        estimate_memory(build, {"input_ids": ids, "labels": ids}, precision="bf16-mixed", extrapolate=extrapolate)
        for extrapolate in (True, False)
    ]
    assert estimates[0].peak == estimates[1].peak and estimates[0].peak_phase == estimates[1].peak_phase == "forward"
    fast, full = estimates
    assert fast.extrapolated and not full.extrapolated
    assert fast.peak_split == full.peak_split and fast.timeline == full.timeline and fast.as_dict() == full.as_dict()


def test_a_phase_off_its_line_at_four_blocks_makes_every_block_simulated():
    """The peak's own phase is straight at 2, 3 and 4 blocks, but a third phase bends at 4 (its peak op moves): its
    2-3 line would be taken for the real depth, where it may overtake. Every block is simulated instead."""
    from torch import nn

    from pl_lowprec.memory.depth import extrapolated
    from pl_lowprec.memory.fake_step import SimulatedStep

    blocks = nn.ModuleList(nn.Identity() for _ in range(8))

    def simulate() -> SimulatedStep:
        n = len(blocks)
        backward = 100 + 10 * n
        bent = 50 + 5 * n + (40 if n >= 4 else 0)  # straight from 2 to 3, off that line at 4
        return SimulatedStep(
            peak=backward,
            peak_phase="backward",
            peak_split={"activations": backward},
            timeline=[("forward peak", bent), ("backward peak", backward)],
            samples=[],
            saved_bytes=n,
            offloaded_bytes=0,
            phase_splits={"forward peak": {"activations": bent}, "backward peak": {"activations": backward}},
        )

    estimate = extrapolated(simulate, blocks)
    assert not estimate.extrapolated
    assert dict(estimate.timeline)["forward peak"] == 50 + 5 * 8 + 40  # the full simulation's, not the line's 90
