"""Shared pieces of the benchmarks: the machine report, interleaved rounds, ratios with their spread, tables, JSON.

Contenders run side by side in one process (or one fresh process each, where memory is measured), in rounds
whose order rotates (A B C, B C A, C A B, ...), so that drift in machine load affects every contender alike.
A ratio is computed within each round and reported as the median over rounds with its min-max spread. No
figure is asserted anywhere.
"""

from __future__ import annotations

import datetime
import itertools
import json
import logging
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any, TypeVar

import lightning.pytorch as pl
import torch

warnings.filterwarnings("ignore", message=r".*LeafSpec.*", category=FutureWarning)
warnings.filterwarnings("ignore", message=r".*(val_dataloader|does not have many workers).*")
logging.getLogger("lightning.pytorch").setLevel(logging.WARNING)  # no "GPU available" lines between tables

RESULTS = Path(__file__).resolve().parent / "results"  # untracked (.gitignore), whatever the working directory
PACKAGES = ("torch", "lightning", "bitsandbytes", "transformers", "peft")
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile")

T = TypeVar("T")


def device() -> torch.device:
    """The device every benchmark runs on: the GPU where there is one, else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _cpuinfo() -> tuple[str, set[str]]:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine(), set()
    model = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), "unknown")
    flags = next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), [])
    return model, set(flags)


def _memory_gib() -> float | None:
    try:
        line = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemTotal"))
    except (OSError, StopIteration):
        return None
    return int(line.split()[1]) / 2**20


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def machine_info() -> dict[str, Any]:
    """What a figure depends on: CPU model and the flags that decide bf16 speed, GPU, date and versions."""
    model, flags = _cpuinfo()
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": model,
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_gib": _memory_gib(),
        "cpu_flags": {flag: flag in flags for flag in CPU_FLAGS},
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "versions": {"python": platform.python_version(), **{p: _version(p) for p in PACKAGES}},
    }


def describe_machine(info: dict[str, Any]) -> str:
    flags = ", ".join(f"{flag} {'yes' if present else 'no'}" for flag, present in info["cpu_flags"].items())
    memory = f"{info['memory_gib']:.0f} GiB" if info["memory_gib"] else "memory unknown"
    versions = ", ".join(f"{name} {v}" for name, v in info["versions"].items())
    return (
        f"Machine: {info['cpu']}, {info['cpu_cores']} cores ({info['torch_threads']} torch threads), {memory}, "
        f"GPU: {info['gpu'] or 'none'}\n"
        f"CPU flags: {flags}; torch CPU capability: {info['torch_cpu_capability']}\n"
        f"Date: {info['date']}\nVersions: {versions}"
    )


def rounds(contenders: dict[str, Callable[[], T]], count: int) -> dict[str, list[T]]:
    """Run every contender once per round, ``count`` rounds, rotating the order; results per contender."""
    names = list(contenders)
    results: dict[str, list[T]] = {name: [] for name in names}
    for r in range(count):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            results[name].append(contenders[name]())
    return results


def ratio(numerators: Sequence[float], denominators: Sequence[float]) -> dict[str, float]:
    """Paired ratios (per round, or per step of the same batch): median, quartiles, min and max."""
    per_pair = [a / b for a, b in zip(numerators, denominators, strict=True)]
    q1, _, q3 = statistics.quantiles(per_pair, n=4, method="inclusive") if len(per_pair) > 1 else per_pair * 3
    return {"median": statistics.median(per_pair), "q1": q1, "q3": q3, "min": min(per_pair), "max": max(per_pair)}


def with_spread(r: dict[str, float], digits: int = 3) -> str:
    """``median (min-max)``."""
    return f"{r['median']:.{digits}f} ({r['min']:.{digits}f}-{r['max']:.{digits}f})"


def quartiles(r: dict[str, float], digits: int = 2) -> str:
    return f"{r['q1']:.{digits}f}-{r['q3']:.{digits}f}"


def extremes(r: dict[str, float], digits: int = 2) -> str:
    return f"{r['min']:.{digits}f}-{r['max']:.{digits}f}"


class StepClock(pl.Callback):
    """Time stamps at each training batch start and at the end of training: step i lasts stamps[i+1]-stamps[i].

    The same measure as ``stamped`` gives a hand-written loop, so both include fetching the batch and
    everything the loop does between two steps."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self.stamps.append(time.perf_counter())

    def on_train_end(self, *args: Any) -> None:
        self.stamps.append(time.perf_counter())

    @property
    def step_times(self) -> list[float]:
        return step_times(self.stamps)


def stamped(batches: Any, stamps: list[float]) -> Any:
    """Yield the batches, stamping the time before each one and once after the last (see ``StepClock``)."""
    for batch in batches:
        stamps.append(time.perf_counter())
        yield batch
    stamps.append(time.perf_counter())


def step_times(stamps: Sequence[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(stamps)]


def quiet_trainer(**kwargs: Any) -> pl.Trainer:
    defaults = dict(
        accelerator=device().type,
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    return pl.Trainer(**{**defaults, **kwargs})


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if not isinstance(value, float):
        return str(value)
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3f}" if abs(value) >= 0.01 else f"{value:.3g}"


def section(title: str) -> None:
    print(f"\n## {title}\n", flush=True)


def write_json(name: str, payload: dict[str, Any]) -> Path:
    """Write ``benchmarks/results/<name>.json`` (anchored at this folder, not the working directory)."""
    path = RESULTS / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine_info(), **payload}, indent=2, default=str))
    return path
