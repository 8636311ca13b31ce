"""Is ``AMPPrecision("auto")`` the fast choice on this machine? Step time of every precision, side by side.

Run: python benchmarks/run_all.py --only precision    (or python benchmarks/precision_choice.py [--rounds N])

Contenders, in rotating order within each round: Lightning's ``"32-true"``, ``AMPPrecision("bf16-mixed")``,
``AMPPrecision("16-mixed")`` and ``AMPPrecision("auto")``, on the quick-start workload (QLoRA nf4-dq + LoRA +
checkpointing, TinyLlama hidden 128) and on a larger LoRA run (TinyLlama hidden 256, 4 layers, 8 x 256 tokens).
Each cell is the median over rounds of each run's median step time, with the min-max over rounds; "auto / best"
is auto's time over the fastest other contender's in the same round (1.00: auto picked the fastest; auto and its
choice run the same code, so their gap is the noise).
"""

from __future__ import annotations

import argparse
import logging
import statistics

import lightning.pytorch as pl
from common import StepClock, device, quiet_trainer, ratio, rounds, section, with_spread, write_json

from pl_lowprec import AMPPrecision, LowPrecisionStrategy, choose_precision
from pl_lowprec.demo import StdlibTextDataModule, TinyLlama

LORA = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"}
WORKLOADS = {
    "quick-start QLoRA (hidden 128, 2 layers, 8 x 128)": dict(
        model=dict(hidden_size=128, num_layers=2),
        seq_len=128,
        steps=10,
        strategy=dict(quantization="nf4-dq", lora=LORA, activation_checkpointing=["LlamaDecoderLayer"]),
    ),
    "LoRA (hidden 256, 4 layers, 8 x 256)": dict(
        model=dict(hidden_size=256, num_layers=4), seq_len=256, steps=5, strategy=dict(lora=LORA)
    ),
}
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "auto")
WARMUP = 2


def median_step_time(workload: dict, precision: str) -> float:
    """One run's median step time after ``WARMUP`` steps."""
    pl.seed_everything(0, verbose=False)
    clock = StepClock()
    trainer = quiet_trainer(
        max_steps=workload["steps"],
        precision="32-true" if precision == "32-true" else None,
        plugins=[] if precision == "32-true" else [AMPPrecision(precision)],
        strategy=LowPrecisionStrategy(**workload["strategy"]),
        callbacks=[clock],
        limit_val_batches=0,
    )
    trainer.fit(TinyLlama(**workload["model"]), StdlibTextDataModule(seq_len=workload["seq_len"], batch_size=8))
    return statistics.median(clock.step_times[WARMUP:])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds per workload (order rotates each round)")
    count = parser.parse_args(argv).rounds
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    choice = choose_precision(device())
    section("Precision for the machine: seconds per step, median (min-max over rounds)")
    print(choice.describe() + "\n")
    headers = ["workload", *PRECISIONS[:-1], f"auto (chose {choice.precision})", "auto / best"]
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    result: dict = {"choice": choice.precision, "reason": choice.reason, "workloads": {}}
    for name, workload in WORKLOADS.items():
        times = rounds({p: (lambda p=p, w=workload: median_step_time(w, p)) for p in PRECISIONS}, count)
        best = min(PRECISIONS[:-1], key=lambda p: statistics.median(times[p]))
        spreads = {p: ratio(times[p], [1.0] * count) for p in PRECISIONS}
        auto_vs_best = ratio(times["auto"], times[best])
        cells = [with_spread(spreads[p]) for p in PRECISIONS]
        lines.append("| " + " | ".join([name, *cells, with_spread(auto_vs_best, 2)]) + " |")
        result["workloads"][name] = {"seconds_per_step": times, "fastest_other": best, "auto_vs_best": auto_vs_best}
    print("\n".join(lines), flush=True)
    write_json("precision_choice", result)
    return result


if __name__ == "__main__":
    main()
