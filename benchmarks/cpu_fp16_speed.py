"""What ``AMPPrecision("16-mixed")`` costs on a CPU: forward + backward of one MLP under fp32, bf16 and fp16 autocast.

Run: python benchmarks/cpu_fp16_speed.py [--rounds 3]

fp16 autocast on CPU computes right (``AMPPrecision`` scales the loss with ``GradScaler("cpu")``), but a CPU
without AMX-FP16 computes fp16 matmuls slowly; the plugin says so when it starts, and docs/precision.md gives
these figures. The MLP (1024 -> 2048 -> 1024 -> 1024, GELU, batch 256) is matmul-bound, as a model's layers are;
a tiny model's step is dominated by overhead and shows a smaller factor. Each round times every precision in
rotating order (median of 5 steps after 2 warm-up steps); the table gives the median and the range over rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from common import describe_machine, machine_info, ratio, rounds, section, with_spread, write_json

PRECISIONS = {"fp32": None, "bf16 autocast": torch.bfloat16, "fp16 autocast": torch.float16}
STEPS, WARMUP = 5, 2


def mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(1024, 2048),
        torch.nn.GELU(),
        torch.nn.Linear(2048, 1024),
        torch.nn.GELU(),
        torch.nn.Linear(1024, 1024),
    )


def median_step_time(model: torch.nn.Module, x: torch.Tensor, dtype: torch.dtype | None) -> float:
    times = []
    for i in range(WARMUP + STEPS):
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = model(x).float().pow(2).mean()
        loss.backward()
        model.zero_grad(set_to_none=True)
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds (the order rotates each round)")
    count = parser.parse_args(argv).rounds
    print(describe_machine(machine_info()))
    section("fp16 on CPU: seconds per forward + backward, median (min-max over rounds)")
    model, x = mlp(), torch.randn(256, 1024)
    times = rounds({name: (lambda d=dtype: median_step_time(model, x, d)) for name, dtype in PRECISIONS.items()}, count)
    fp32 = times["fp32"]
    print("| precision | seconds per step | / fp32 |\n|---|---|---|")
    for name in PRECISIONS:
        seconds, relative = ratio(times[name], [1.0] * count), ratio(times[name], fp32)
        print(f"| {name} | {with_spread(seconds)} | {with_spread(relative, 1)} |")
    write_json("cpu_fp16_speed", {"seconds_per_step": times})
    return times


if __name__ == "__main__":
    main()
