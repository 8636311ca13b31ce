"""Estimating deep models fast: simulate 2 and 3 of their identical blocks and extrapolate linearly.

A fake step dispatches about 2,000 ops per transformer block at 100-200 us each, so 32 blocks of an 8B model take
5 s and 80 blocks of a 70B model 21 s. Every figure of a step over L identical blocks is linear in L (each block
adds the same weights, saved activations and gradients; the peak sits at the same op, one block further), so
``x(L) = x(2) + (L - 2) * (x(3) - x(2))`` gives the same bytes (checked against the full simulation on 8B and 70B
shapes, and in tests/memory/test_depth.py) as long as the peak stays at the same op. A third run with 4 blocks
checks that: when its figures leave the line (with batch 1 x 2048 on 8B shapes, the peak sits in a block's
recompute at 2 blocks and at the loss at 32), every block is simulated instead. Where another phase's line
overtakes the peak's before the real depth (a full fine-tune's forward, which holds the last step's gradients; a
checkpointed QLoRA forward over short sequences, as Llama-3.2-1B's at 1 x 64), that phase's peak and split, if they
lie on a line at 2-4 blocks too, give the figures: the same bytes as simulating every block (test_depth.py). Used
only where the blocks are interchangeable: one class, the same parameter shapes, dtypes and trainability, and all
checkpointed or none.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from torch import nn

from pl_lowprec.memory.fake_step import SimulatedStep
from pl_lowprec.memory.op_counts import OpProfile
from pl_lowprec.transforms.checkpointing import is_checkpointed

MIN_DEPTH = 5  # up to 4, simulating every block is as fast


def _signature(block: nn.Module) -> tuple:
    params = tuple((n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in block.named_parameters())
    checkpointed = tuple(is_checkpointed(m) for m in block.modules())
    return type(block), params, checkpointed


def repeated_blocks(model: nn.Module) -> nn.ModuleList | None:
    """The model's longest stack of interchangeable blocks (at least ``MIN_DEPTH``), or ``None``."""
    best: nn.ModuleList | None = None
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) >= MIN_DEPTH and (best is None or len(module) > len(best)):
            first = _signature(module[0])
            if all(_signature(block) == first for block in module):
                best = module
    return best


@contextmanager
def keep_first(blocks: nn.ModuleList, count: int) -> Iterator[None]:
    """Inside, ``blocks`` holds only its first ``count`` blocks (what the model's loop over them runs)."""
    everything = list(blocks)
    del blocks[count:]
    try:
        yield
    finally:
        blocks.extend(everything[count:])


def _line(at_2: float, at_3: float, depth: int) -> int:
    return round(at_2 + (depth - 2) * (at_3 - at_2))


def _on_a_line(*points: tuple[int, dict[str, int]]) -> bool:
    """Whether a figure and its split by category at 2, 3 and 4 blocks (``points``) grow by the same step."""
    (at_2, split_2), (at_3, split_3), (at_4, split_4) = points
    categories = set(split_2) | set(split_3) | set(split_4)
    return at_4 - at_3 == at_3 - at_2 and all(
        split_4.get(k, 0) - split_3.get(k, 0) == split_3.get(k, 0) - split_2.get(k, 0) for k in categories
    )


def extrapolated(simulate: Callable[[], SimulatedStep], blocks: nn.ModuleList) -> SimulatedStep:
    """``simulate()`` with 2 and 3 of ``blocks``, extrapolated to ``len(blocks)``, when a run with 4 blocks lies on
    the same line; else (the peak moves from one op to another as blocks are added) every block is simulated."""
    depth = len(blocks)
    runs = {}
    for count in (2, 3, 4):
        with keep_first(blocks, count):
            runs[count] = simulate()
    two, three, four = runs[2], runs[3], runs[4]
    if depth == 4:
        return four
    straight = two.peak_phase == three.peak_phase == four.peak_phase and _on_a_line(
        *((s.peak, s.peak_split) for s in (two, three, four))
    )
    straight = straight and [n for n, _ in two.timeline] == [n for n, _ in three.timeline]
    straight = straight and [n for n, _ in two.timeline] == [n for n, _ in four.timeline]
    straight = straight and all(  # every phase, not the peak's alone: another may overtake it before the depth
        d - c == c - b for (_, b), (_, c), (_, d) in zip(two.timeline, three.timeline, four.timeline, strict=True)
    )
    if not straight:
        return simulate()
    timeline = [(n, _line(a, b, depth)) for (n, a), (_, b) in zip(two.timeline, three.timeline, strict=True)]
    peak, peak_phase, splits = _line(two.peak, three.peak, depth), three.peak_phase, (two.peak_split, three.peak_split)
    overtaking, highest = max(timeline, key=lambda entry: entry[1])  # the first phase at the highest
    if highest > peak:  # another phase's line overtakes the peak's before the real depth (a full fine-tune's
        # forward, which holds the last step's gradients; a QLoRA forward over short sequences): its line, if it is one
        phase = [(s.phase_splits.get(overtaking), dict(s.timeline)[overtaking]) for s in (two, three, four)]
        if any(split is None for split, _ in phase) or not _on_a_line(*((v, split) for split, v in phase)):
            return simulate()
        peak, peak_phase = highest, overtaking.removesuffix(" peak")
        splits = (phase[0][0], phase[1][0])
    categories = set(splits[0]) | set(splits[1])
    return SimulatedStep(
        peak=peak,
        peak_phase=peak_phase,
        peak_split={k: _line(splits[0].get(k, 0), splits[1].get(k, 0), depth) for k in categories},
        timeline=timeline,
        samples=three.samples,  # the shape of the step, for the plot, at 3 blocks
        saved_bytes=_line(two.saved_bytes, three.saved_bytes, depth),
        offloaded_bytes=_line(two.offloaded_bytes, three.offloaded_bytes, depth),
        host_peak=_line(two.host_peak, three.host_peak, depth),
        optimizer_state=_line(two.optimizer_state, three.optimizer_state, depth),
        extrapolated=True,
        ops=OpProfile.line(two.ops, three.ops, depth - 2),
        repeated_micro_batches=three.repeated_micro_batches,
    )
