"""Step-time overhead of LossScaleMonitor and MemoryTracker at their default settings.

Run: python benchmarks/callback_overhead.py [--rounds 5] [--steps 20]
TinyGPT (dim 64, 2 layers, batch 8 x 128 bytes) under AMPPrecision("16-mixed"); each contender trains for
``--steps`` steps per round, rounds alternate the contenders, the first 2 steps of each run are dropped.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
from common import StepTimer, interleaved, machine, markdown_table, write_json

from pl_lowprec import AMPPrecision, LossScaleMonitor, MemoryTracker
from pl_lowprec.demo import TinyGPT


def _loader(steps: int) -> torch.utils.data.DataLoader:
    ids = torch.randint(0, 256, (steps * 8, 129), generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader([{"input_ids": r} for r in ids], batch_size=8)


def run(callbacks: list[pl.Callback], steps: int) -> list[float]:
    timer = StepTimer()
    torch.manual_seed(0)
    trainer = pl.Trainer(
        accelerator="auto",
        devices=1,
        max_steps=steps,
        plugins=[AMPPrecision("16-mixed")],
        callbacks=[*callbacks, timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyGPT(dim=64, layers=2, heads=4), _loader(steps))
    return timer.times


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    contenders = {
        "no callbacks": lambda: run([], args.steps),
        "LossScaleMonitor": lambda: run([LossScaleMonitor(print_summary=False)], args.steps),
        "MemoryTracker": lambda: run([MemoryTracker(print_summary=False)], args.steps),
        "both": lambda: run([LossScaleMonitor(print_summary=False), MemoryTracker(print_summary=False)], args.steps),
    }
    medians = interleaved(contenders, args.rounds)
    base = medians["no callbacks"]
    rows = [(name, t * 1e3, t / base) for name, t in medians.items()]
    print(f"Callback overhead on {machine()} ({args.rounds} rounds x {args.steps} steps, medians)\n")
    print(markdown_table(["contender", "step ms", "ratio to none"], rows))
    result = {"medians_s": medians, "ratios": {n: t / base for n, t in medians.items()}}
    write_json("callback_overhead", result)
    return result


if __name__ == "__main__":
    main()
