"""What is alive at the CUDA peak of one ``train_once.py`` run, grouped by the frames that allocated it.

python benchmarks/cuda_peak_snapshot.py LABEL -- TRAIN_ONCE ARGUMENTS...

The run goes under ``torch.cuda.memory._record_memory_history`` (Python frames); its allocation trace is replayed
to the highest total of live blocks, and the blocks alive then are grouped by their first frames in the libraries
that matter (this package, transformers, peft, bitsandbytes, inductor's generated code), largest first. It found
what compiled blocks kept under torch 2.11 (docs/benchmarks.md, run 3). On a CPU it runs the training and
reports nothing.
"""

from __future__ import annotations

import collections
import os
import runpy
import sys
from pathlib import Path
from typing import Any

import torch

KEEP = ("pl_lowprec", "transformers", "peft", "torchinductor", "bitsandbytes", "train_once", "lightning/pytorch/loops")


def frames_key(frames: list[dict[str, Any]]) -> str:
    """The allocation's first four frames in the libraries of ``KEEP``, innermost first."""
    picked = [
        f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}"
        for f in frames
        if any(k in f["filename"] for k in KEEP)
    ]
    return " < ".join(picked[:4]) or (f"{frames[0]['filename']}:{frames[0]['line']}" if frames else "?")


def live_at_peak(events: list[dict[str, Any]]) -> tuple[int, list[dict[str, Any]]]:
    """The highest total of live blocks over the trace, and the allocation events alive then."""
    live: dict[int, dict[str, Any]] = {}
    total = peak = 0
    at_peak: list[dict[str, Any]] = []
    for event in events:
        if event["action"] == "alloc":
            live[event["addr"]] = event
            total += event["size"]
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
        if total > peak:
            peak, at_peak = total, list(live.values())
    return peak, at_peak


def report(label: str, events: list[dict[str, Any]], rows: int = 30) -> list[str]:
    peak, alive = live_at_peak(events)
    groups: dict[str, list[Any]] = collections.defaultdict(lambda: [0, 0, set()])
    for event in alive:
        group = groups[frames_key(event.get("frames", []))]
        group[0] += event["size"]
        group[1] += 1
        group[2].add(round(event["size"] / 2**20, 1))
    lines = [f"[{label}] {len(events)} trace events; peak of live blocks {peak / 2**30:.3f} GiB"]
    for key, (size, count, sizes) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:rows]:
        lines.append(f"[{label}] {size / 2**20:9.1f} MiB {count:5d} blocks (MiB {sorted(sizes)[-4:]}) {key[:400]}")
    return lines


def main() -> None:
    label, rest = sys.argv[1], sys.argv[sys.argv.index("--") + 1 :]
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    sys.argv = ["train_once.py", *rest]
    try:
        runpy.run_path(str(Path(__file__).with_name("train_once.py")), run_name="__main__")
    finally:
        events = torch.cuda.memory._snapshot()["device_traces"][0] if cuda else []
        if cuda:
            torch.cuda.memory._record_memory_history(enabled=None)
    print("\n".join(report(label, events)))


if __name__ == "__main__":
    main()
