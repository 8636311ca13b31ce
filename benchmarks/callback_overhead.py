"""Cost of LossScaleMonitor and MemoryTracker at their default settings, per step and per fit.

Run: python benchmarks/run_all.py --only callbacks   (or python benchmarks/callback_overhead.py [--rounds 5])

TinyGPT (dim 64, 2 layers, batch 8 x 128 bytes) under AMPPrecision("16-mixed") (a live loss scaler, which
LossScaleMonitor reads every step). Everything the callbacks do is inside the timings: per step is the mean
over all steps, the first included, which is MemoryTracker's sampled step (``activation_sample_step=0``:
saved-tensor hooks and the gradient count); per fit is the wall time of ``trainer.fit``, which includes the
end-of-fit work (MemoryTracker's breakdown walk, the gather across ranks and its JSON file; LossScaleMonitor's
summary). Only the printing of the summaries is switched off. Rounds rotate the order of the contenders.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Any

import lightning.pytorch as pl
import torch
from common import StepClock, extremes, markdown_table, quartiles, quiet_trainer, ratio, rounds, section, write_json

from pl_lowprec import AMPPrecision, LossScaleMonitor, MemoryTracker
from pl_lowprec.demo import TinyGPT


def _loader(steps: int) -> torch.utils.data.DataLoader:
    ids = torch.randint(0, 256, (steps * 8, 129), generator=torch.Generator().manual_seed(0))
    return torch.utils.data.DataLoader([{"input_ids": r} for r in ids], batch_size=8)


def run(callbacks: list[pl.Callback], steps: int) -> dict[str, float]:
    clock = StepClock()
    torch.manual_seed(0)
    model = TinyGPT(dim=64, layers=2, heads=4)
    with tempfile.TemporaryDirectory() as root:  # MemoryTracker writes memory_summary.json here
        trainer = quiet_trainer(
            max_steps=steps, plugins=[AMPPrecision("16-mixed")], callbacks=[*callbacks, clock], default_root_dir=root
        )
        start = time.perf_counter()
        trainer.fit(model, _loader(steps))
        fit_s = time.perf_counter() - start
    return {"step_s": statistics.mean(clock.step_times), "fit_s": fit_s}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args(argv)

    def monitor() -> LossScaleMonitor:
        return LossScaleMonitor(print_summary=False)

    def tracker() -> MemoryTracker:
        return MemoryTracker(print_summary=False)

    contenders = {
        "no callbacks": lambda: run([], args.steps),
        "LossScaleMonitor": lambda: run([monitor()], args.steps),
        "MemoryTracker": lambda: run([tracker()], args.steps),
        "both": lambda: run([monitor(), tracker()], args.steps),
    }
    results = rounds(contenders, args.rounds)
    base = results["no callbacks"]
    summary, rows = {}, []
    for name, runs in results.items():
        per_step = ratio([r["step_s"] for r in runs], [r["step_s"] for r in base])
        per_fit = ratio([r["fit_s"] for r in runs], [r["fit_s"] for r in base])
        extra_ms = statistics.median((r["fit_s"] - b["fit_s"]) * 1e3 for r, b in zip(runs, base, strict=True))
        summary[name] = {"per_step": per_step, "per_fit": per_fit, "extra_ms_per_fit": extra_ms}
        mean_step = statistics.median(r["step_s"] for r in runs) * 1e3
        rows.append(
            (
                name,
                mean_step,
                f"{per_step['median']:.3f} ({quartiles(per_step)}; {extremes(per_step)})",
                f"{per_fit['median']:.3f} ({quartiles(per_fit)}; {extremes(per_fit)})",
                f"{extra_ms:+.0f}",
            )
        )
    section(
        f"Callbacks: time ratio to no callbacks, TinyGPT dim 64, fp16 AMPPrecision, {args.rounds} rounds x "
        f"{args.steps} steps: median (interquartile range; min-max) over rounds"
    )
    print(
        markdown_table(
            ["callbacks", "mean step ms", "per step (all steps)", "per fit (trainer.fit wall time)", "ms per fit"],
            rows,
        )
    )
    write_json("callback_overhead", {"results": results, "summary": summary, "args": vars(args)})
    return summary


if __name__ == "__main__":
    main()
