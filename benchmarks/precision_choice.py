"""Is ``AMPPrecision("auto")`` the fast choice on this machine? Step time of every precision, side by side.

Run: python benchmarks/precision_choice.py [--rounds 3]

Contenders, in alternating order within each round: Lightning's ``"32-true"``, ``AMPPrecision("bf16-mixed")``,
``AMPPrecision("16-mixed")`` and ``AMPPrecision("auto")``, on the quick-start workload (QLoRA nf4-dq + LoRA +
checkpointing, TinyLlama hidden 128) and on a larger LoRA run (TinyLlama hidden 256, 4 layers, 8 x 256 tokens).
Prints the CPU (or GPU), the capabilities torch reports, and for each contender the median step time over all
rounds with the range of the per-round medians; "auto / best" is auto's median over the fastest contender's
(1.00 means auto picked the fastest; auto and its choice run the same code, so their gap is the noise).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from pathlib import Path

import lightning.pytorch as pl
import torch
from common import StepTimer, machine, markdown_table, write_json

from pl_lowprec import AMPPrecision, LowPrecisionStrategy, choose_precision
from pl_lowprec.demo import StdlibTextDataModule, TinyLlama
from pl_lowprec.plugins.precision_choice import cpu_native_bf16

LORA = {"r": 8, "lora_alpha": 16, "target_modules": "all-linear"}
WORKLOADS = {
    "quick-start QLoRA (hidden 128, 2 layers, 8x128)": dict(
        model=dict(hidden_size=128, num_layers=2),
        seq_len=128,
        steps=10,
        strategy=dict(quantization="nf4-dq", lora=LORA, activation_checkpointing=["LlamaDecoderLayer"]),
    ),
    "LoRA (hidden 256, 4 layers, 8x256)": dict(
        model=dict(hidden_size=256, num_layers=4), seq_len=256, steps=5, strategy=dict(lora=LORA)
    ),
}
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed", "auto")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown CPU"


def run_once(workload: dict, precision: str) -> list[float]:
    pl.seed_everything(0, verbose=False)
    timer = StepTimer()
    plugins = [] if precision == "32-true" else [AMPPrecision(precision)]
    trainer = pl.Trainer(
        accelerator="auto",
        devices=1,
        max_steps=workload["steps"],
        precision="32-true" if precision == "32-true" else None,
        plugins=plugins,
        strategy=LowPrecisionStrategy(**workload["strategy"]),
        callbacks=[timer],
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = StdlibTextDataModule(seq_len=workload["seq_len"], batch_size=8)
    trainer.fit(TinyLlama(**workload["model"]), data)
    return timer.times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds per workload")
    rounds = parser.parse_args().rounds
    logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    choice = choose_precision(device)
    native, found = cpu_native_bf16()
    print(f"Machine: {machine()}; CPU: {cpu_model()}; {found}; native bf16: {native}")
    print(f"Date: {time.strftime('%Y-%m-%d')}. {choice.describe()}\n")
    rows, payload = [], {}
    for name, workload in WORKLOADS.items():
        samples: dict[str, list[float]] = {p: [] for p in PRECISIONS}
        round_medians: dict[str, list[float]] = {p: [] for p in PRECISIONS}
        for index in range(rounds):
            order = PRECISIONS if index % 2 == 0 else PRECISIONS[::-1]  # alternate who runs first
            for precision in order:
                times = run_once(workload, precision)[2:]  # the first two steps warm up
                samples[precision] += times
                round_medians[precision].append(statistics.median(times))
        medians = {p: statistics.median(samples[p]) for p in PRECISIONS}
        best = min(medians[p] for p in PRECISIONS if p != "auto")
        cells = [f"{medians[p]:.3f} ({min(round_medians[p]):.3f}-{max(round_medians[p]):.3f})" for p in PRECISIONS]
        rows.append([name, *cells, choice.precision, medians["auto"] / best])
        payload[name] = {"median_s": medians, "round_medians_s": round_medians}
    headers = ["workload", *(f"{p} s/step (range)" for p in PRECISIONS), "auto chose", "auto / best"]
    print(markdown_table(headers, rows))
    write_json("precision_choice", {"cpu": cpu_model(), "choice": choice.precision, "step_s": payload})


if __name__ == "__main__":
    main()
