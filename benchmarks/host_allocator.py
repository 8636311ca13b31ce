"""A CPU step with glibc's default allocator against one that keeps freed blocks for reuse, side by side.

Run: python benchmarks/host_allocator.py [--rounds 2] [--steps 10]

glibc maps each block of 32 MiB or more anew and unmaps it on free, so every step's large tensors are faulted in
and zeroed by the OS again (``op_counts.FRESH_PAGES``; the step-time prediction counts it as "fresh pages").
``MALLOC_MMAP_MAX_=0`` serves them from the heap and ``MALLOC_TRIM_THRESHOLD_`` (64 GiB) keeps the heap's freed top,
so a step reuses the pages of the one before, as jemalloc and tcmalloc do (``python -m torch.backends.xeon.run_cpu
--enable_jemalloc``). Each contender is a fresh process (glibc reads these at start), in rounds whose order
alternates: ``cpu_step_prediction.py``'s SmolLM2-135M workload (2 blocks, a 49,152-row vocabulary, batch 8 x 512,
nf4-dq, LoRA r=8, ``"auto"`` settings), its median step from step 3 on, its prediction before loading, the
predicted fresh pages, and the process's peak resident memory (``ru_maxrss``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from common import describe_machine, machine_info, markdown_table, section, write_json

from pl_lowprec.memory.step_time import KEEP_FREED_BLOCKS

CONTENDERS = {"glibc default": {}, "keep freed blocks": KEEP_FREED_BLOCKS}
CHILD = """
import json, resource, sys, tempfile
sys.path.insert(0, sys.argv[1])
from cpu_step_prediction import _smollm2_two_blocks, measure
with tempfile.TemporaryDirectory() as root:
    result = measure(lambda: _smollm2_two_blocks(root), int(sys.argv[2]))
result["max_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print("RESULT " + json.dumps(result))
"""


def run_contender(extra_env: dict[str, str], steps: int) -> dict[str, Any]:
    env = {**os.environ, **extra_env}
    here = str(Path(__file__).resolve().parent)
    done = subprocess.run(
        [sys.executable, "-c", CHILD, here, str(steps)], env=env, capture_output=True, text=True, timeout=900
    )
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(line.removeprefix("RESULT "))


def main(argv: list[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="rounds; the order alternates between them")
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps per run; the median is from step 3")
    args = parser.parse_args(argv)
    print(describe_machine(machine_info()))
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in CONTENDERS}
    names = list(CONTENDERS)
    for round_index in range(args.rounds):
        for name in names if round_index % 2 == 0 else names[::-1]:
            results[name].append(run_contender(CONTENDERS[name], args.steps))
    section("SmolLM2-135M shapes, 2 blocks, 8 x 512 on this CPU: glibc's allocator against freed blocks kept")
    baseline = [r["measured"] for r in results["glibc default"]]
    rows = []
    for name, runs in results.items():
        measured = [r["measured"] for r in runs]
        rows.append(
            [
                name,
                " / ".join(f"{m:.3f}" for m in measured),
                " / ".join(f"{b / m:.2f}x" for b, m in zip(baseline, measured, strict=True)),
                " / ".join(f"{r['predicted']:.3f}" for r in runs),
                " / ".join(f"{r['predicted'] - r['no_fresh_pages']:.3f}" for r in runs),
                " / ".join(f"{r['max_rss'] / 2**30:.2f}" for r in runs),
            ]
        )
    headers = [
        "allocator",
        "measured s (each round)",
        "speed-up over glibc's default",
        "predicted s",
        "of it fresh pages s",
        "peak resident GiB",
    ]
    print(markdown_table(headers, rows))
    write_json("host_allocator", {"steps": args.steps, "rounds": args.rounds, "results": results})
    return results


if __name__ == "__main__":
    main()
