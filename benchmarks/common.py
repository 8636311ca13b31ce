"""Shared pieces of the benchmarks: per-step timing, interleaved rounds, a markdown table and JSON output.

Contenders always run side by side in one process and in alternating order (A B C A B C ...), and results are
medians over rounds, so drift in machine load affects every contender alike. No figure is asserted anywhere.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

warnings.filterwarnings("ignore", message=r".*LeafSpec.*", category=FutureWarning)


class StepTimer(pl.Callback):
    """Wall time of each training batch, from batch start to batch end."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._start)


def interleaved(contenders: dict[str, Callable[[], list[float]]], rounds: int, warmup: int = 2) -> dict[str, float]:
    """Run each contender ``rounds`` times in alternating order; return the median step time of each."""
    samples: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, run in contenders.items():
            samples[name].extend(run()[warmup:])
    return {name: statistics.median(times) for name, times in samples.items()}


def machine() -> str:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"CPU ({platform.processor() or 'x86_64'})"
    return f"{device}, {torch.get_num_threads()} threads, torch {torch.__version__}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if not isinstance(value, float):
        return str(value)
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3f}" if abs(value) >= 0.01 else f"{value:.3g}"


def write_json(name: str, payload: dict[str, Any], folder: str | Path = "benchmarks/results") -> Path:
    path = Path(folder) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine(), **payload}, indent=2))
    return path
