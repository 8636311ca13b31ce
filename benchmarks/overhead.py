"""Step time of Trainer + AMPPrecision against Lightning's own MixedPrecision and the plain hand-written loop.

Run: python benchmarks/run_all.py --only overhead   (or python benchmarks/overhead.py [--rounds 5] [--steps 10])

Under fp16 (a live GradScaler in all three: AMPPrecision's skip-aware bookkeeping, Lightning's scaler, and
``torch.amp.GradScaler`` in the loop) and under bf16 (no scaler). The plain loop is
``examples/plain_amp_loop.py``'s ``train_plain_loop``; the Lightning contenders run the same model, loss,
AdamW, clipping at 1.0 and batches. A step is the time from one batch start to the next (data fetch included
on both sides); the first 2 steps of each run are dropped and each run gives its median.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

import torch
from common import (
    StepClock,
    device,
    extremes,
    markdown_table,
    quartiles,
    quiet_trainer,
    ratio,
    rounds,
    section,
    stamped,
    step_times,
    write_json,
)
from lightning.pytorch.plugins import MixedPrecision
from torch.nn import functional as F

from pl_lowprec import AMPPrecision
from pl_lowprec.demo import TinyGPT

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from plain_amp_loop import train_plain_loop

LR, CLIP, BATCH, SEQ, WARMUP = 3e-3, 1.0, 8, 128, 2
PRECISIONS = {"fp16": "16-mixed", "bf16": "bf16-mixed"}


class NextByteGPT(TinyGPT):
    """TinyGPT with exactly the plain loop's work: ``F.cross_entropy(model(x), y)`` and a constant-LR AdamW."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids).transpose(1, 2)  # [B, vocab, T]: the class dimension second

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=LR)


def _model() -> NextByteGPT:
    torch.manual_seed(0)
    return NextByteGPT(dim=64, layers=2, heads=4, max_len=SEQ)


def _loader(steps: int) -> torch.utils.data.DataLoader:
    ids = torch.randint(0, 256, (steps * BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids[:, :-1], ids[:, 1:]), batch_size=BATCH)


def plain_loop(precision: str, steps: int) -> dict[str, Any]:
    model = _model().to(device())
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    stamps: list[float] = []
    batches = stamped(_loader(steps), stamps)
    train_plain_loop(model, batches, optimizer, precision, accumulate=1, clip=CLIP, device=device().type)
    return {"step_s": statistics.median(step_times(stamps)[WARMUP:])}


def lightning(plugin: MixedPrecision, steps: int) -> dict[str, Any]:
    clock = StepClock()
    quiet_trainer(max_steps=steps, plugins=[plugin], callbacks=[clock], gradient_clip_val=CLIP).fit(
        _model(), _loader(steps)
    )
    result: dict[str, Any] = {"step_s": statistics.median(clock.step_times[WARMUP:])}
    if plugin.scaler is not None:
        result["final_scale"] = plugin.scaler.get_scale()
    if isinstance(plugin, AMPPrecision) and plugin.scaler is not None:
        result["skipped_steps"] = plugin.loss_scale_state().skipped_steps
    return result


def contenders(steps: int) -> dict[str, Any]:
    runs = {}
    for short, precision in PRECISIONS.items():
        runs[f"{short}: plain loop"] = lambda p=precision: plain_loop(p, steps)
        runs[f"{short}: Lightning MixedPrecision"] = lambda p=precision: lightning(
            MixedPrecision(p, device().type), steps
        )
        runs[f"{short}: Trainer + AMPPrecision"] = lambda p=precision: lightning(AMPPrecision(p), steps)
    return runs


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)
    results = rounds(contenders(args.steps), args.rounds)
    rows, summary = [], {}
    for name, runs in results.items():
        short = name.partition(":")[0]
        base = [r["step_s"] for r in results[f"{short}: plain loop"]]
        times = [r["step_s"] for r in runs]
        summary[name] = {"step_s": times, "ratio_to_plain": ratio(base, times)}  # speed ratio: plain / contender
        speed = summary[name]["ratio_to_plain"]
        rows.append((name, 1 / statistics.median(times), f"{speed['median']:.3f}", quartiles(speed), extremes(speed)))
    section(
        f"Overhead: steps/s, TinyGPT dim 64, batch {BATCH} x {SEQ}, {device().type.upper()}, "
        f"{args.rounds} rounds x {args.steps} steps"
    )
    headers = ["contender", "steps/s (median)", "speed vs plain loop (median)", "interquartile range", "min-max"]
    print(markdown_table(headers, rows))
    live = {
        name: (runs[-1].get("final_scale"), runs[-1].get("skipped_steps"))
        for name, runs in results.items()
        if name.startswith("fp16") and "plain" not in name
    }
    print(
        "\nfp16 loss scale at the end of the last round (skipped steps where counted): "
        + "; ".join(
            f"{n.partition(': ')[2]} {s:g}" + (f", {k} skipped" if k is not None else "") for n, (s, k) in live.items()
        )
    )
    write_json("overhead", {"results": results, "summary": summary, "args": vars(args)})
    return summary


if __name__ == "__main__":
    main()
