"""Where each of the first optimizer steps of a ``pl-lowprec fit`` run spends its time: a diagnostic for stalls.

Run: python benchmarks/step_timeline.py [--steps 10] [--sync hooks|steps|none] -- FIT ARGUMENTS...
for example
    python benchmarks/step_timeline.py -- --config configs/finetune-causal-lm.yaml
The fit arguments are those of ``pl-lowprec fit`` (the run is built by the same ``LowPrecisionCLI``, with
``--trainer.max_steps`` set to ``--steps``, no checkpoint written unless the config asks for it). For each
optimizer step it prints the wall time and, beside it, what a stall is made of:

- every Lightning hook, loop phase and strategy call, timed by a Lightning ``Profiler`` (the names are
  Lightning's: ``[Callback]MemoryTracker.on_train_batch_end``, ``[Strategy]LowPrecisionStrategy.backward``...;
  they nest: the optimizer step holds the training steps and backward of its micro-batches). "batches s" is
  Lightning's ``run_training_batch`` (forward, backward, optimizer step), "rest s" the remainder of the step:
  the batch hooks, the data loader, the learning-rate scheduler, the loggers;
- the loggers' ``log_metrics``, ``log_hyperparams`` and ``save`` (Lightning does not profile them);
- Python's garbage collector (``gc.callbacks``; ``--gc default`` turns off the strategy's ``gc.freeze()`` to see
  CPython's full collections as they were), the modules first imported during the step (a lazy import of
  a library, NVML, a logger backend), and on CUDA the caching allocator's ``cudaMalloc`` and ``cudaFree`` calls
  and its retries (``torch.cuda.memory_stats``).

A step is the window from the first micro-batch's ``on_train_batch_start`` to the next one's (the next batch's
fetch from the data loader falls in the window before it). With ``--sync hooks`` (the default on CUDA) every
timed call starts and ends with ``torch.cuda.synchronize()``, so GPU work queued by one call is not charged to
the next one that waits for it (a ``.item()`` in a logger, say); the steps are then slower than unsynchronized
ones, but each second is where it was spent. Then: every call whose time at one step exceeds its median over
the steps after the first two by more than 20 ms, the likely stall.
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from common import describe_machine, machine_info, markdown_table
from lightning.pytorch.profilers import Profiler

OUTLIER_SECONDS = 0.02
PARENTS = ("run_training_epoch", "run_training_batch")  # spans of the loop that hold the other calls


class Timeline:
    """Seconds per (step, what) and the step boundaries; ``step`` is the optimizer step being taken."""

    def __init__(self, sync: str) -> None:
        self.sync = sync
        self.step = -1
        self.seconds: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.counts: dict[int, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self.starts: list[float] = []
        self.imports: dict[int, list[str]] = defaultdict(list)
        self._modules = set(sys.modules)
        self._allocator = _allocator_counts()
        self.objects = (0, 0)  # Python objects tracked by the collector at the first step, and of them frozen

    def synchronize(self, level: str) -> None:
        if torch.cuda.is_available() and self.sync in (level, "hooks"):
            torch.cuda.synchronize()

    def add(self, what: str, seconds: float) -> None:
        self.seconds[self.step][what] += seconds

    def begin_step(self, step: int) -> None:
        self.synchronize("steps")
        now = time.perf_counter()
        self._close_step()
        self.step = step
        self.starts.append(now)

    def finish(self) -> None:
        self.synchronize("steps")
        self.starts.append(time.perf_counter())
        self._close_step()

    def _close_step(self) -> None:
        modules = set(sys.modules)
        new = sorted(m for m in modules - self._modules if "." not in m)
        self.imports[self.step].extend(new)
        self._modules = modules
        allocator = _allocator_counts()
        for key, value in allocator.items():
            self.counts[self.step][key] = value - self._allocator.get(key, 0)
        self._allocator = allocator


def _allocator_counts() -> dict[str, float]:
    if not torch.cuda.is_available():
        return {}
    stats = torch.cuda.memory_stats()
    keys = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")
    return {key: float(stats.get(key, 0)) for key in keys}


class TimelineProfiler(Profiler):
    """Lightning's profiler interface, recording each action's seconds under the current step."""

    def __init__(self, timeline: Timeline) -> None:
        super().__init__()
        self.timeline = timeline
        self._started: dict[str, float] = {}

    def start(self, action_name: str) -> None:
        self.timeline.synchronize("hooks")
        self._started[action_name] = time.perf_counter()

    def stop(self, action_name: str) -> None:
        start = self._started.pop(action_name, None)
        if start is not None and StepBoundaries.__name__ not in action_name:  # not this script's own callback
            self.timeline.synchronize("hooks")
            self.timeline.add(action_name, time.perf_counter() - start)

    def summary(self) -> str:
        return ""


class StepBoundaries(pl.Callback):
    """Starts a step in the timeline at the first micro-batch of each optimizer step."""

    def __init__(self, timeline: Timeline) -> None:
        self.timeline = timeline

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.timeline.step == -1:  # after every on_train_start hook: the strategy's freeze is done
            self.timeline.objects = (len(gc.get_objects()), gc.get_freeze_count())
        if trainer.global_step != self.timeline.step:
            self.timeline.begin_step(trainer.global_step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.timeline.finish()


def time_loggers(trainer: pl.Trainer, timeline: Timeline) -> None:
    """Wrap each logger's ``log_metrics``, ``log_hyperparams`` and ``save`` with a timer."""
    for logger in trainer.loggers:
        for name in ("log_metrics", "log_hyperparams", "save"):
            setattr(logger, name, _timed(getattr(logger, name), f"[Logger]{type(logger).__name__}.{name}", timeline))


def _timed(method: Callable[..., Any], what: str, timeline: Timeline) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        timeline.synchronize("hooks")
        start = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            timeline.synchronize("hooks")
            timeline.add(what, time.perf_counter() - start)

    return timed


def time_garbage_collection(timeline: Timeline) -> Callable[[str, dict[str, int]], None]:
    started: list[float] = []

    def callback(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            timeline.add(f"[gc] generation {info.get('generation')}", time.perf_counter() - started.pop())

    gc.callbacks.append(callback)
    return callback


def report(timeline: Timeline) -> dict[str, Any]:
    steps = sorted(s for s in timeline.seconds if s >= 0)
    wall = {s: timeline.starts[i + 1] - timeline.starts[i] for i, s in enumerate(steps) if i + 1 < len(timeline.starts)}
    rows, result = [], {}
    for step in steps:
        parts = timeline.seconds[step]
        calls = {k: v for k, v in parts.items() if k not in PARENTS}
        top = sorted(calls.items(), key=lambda kv: -kv[1])[:3]
        batches = parts.get("run_training_batch", 0.0)
        gc_seconds = sum(v for k, v in parts.items() if k.startswith("[gc]"))
        logger_seconds = sum(v for k, v in parts.items() if k.startswith("[Logger]"))
        counts = timeline.counts.get(step, {})
        allocator = ", ".join(f"{k.removeprefix('num_')} {int(v)}" for k, v in counts.items() if v) or "-"
        rows.append(
            (step, f"{wall.get(step, float('nan')):.3f}", f"{batches:.3f}",
             f"{wall.get(step, float('nan')) - batches:.3f}", f"{gc_seconds:.3f}", f"{logger_seconds:.3f}",
             allocator, ", ".join(timeline.imports.get(step, [])[:6]) or "-",
             "; ".join(f"{k} {v:.3f}" for k, v in top))
        )  # fmt: skip
        result[str(step)] = {"seconds": wall.get(step), "parts": dict(parts), "allocator": dict(counts)}
    headers = ["step", "wall s", "batches s", "rest s", "gc s", "loggers s", "allocator (CUDA)", "first imported",
               "slowest calls (s)"]  # fmt: skip
    print(markdown_table(headers, rows))
    settled = [wall[s] for s in steps if s >= 2 and s in wall]
    if settled:
        print(f"\nMedian step over steps 2+: {statistics.median(settled):.3f} s; slowest {max(settled):.3f} s.")
    outliers = find_outliers(timeline, steps)
    print("\nCalls that took longer at one step than their median over steps 2+ (by more than 20 ms):")
    print("\n".join(f"- step {s}: {what} {v:.3f} s (median {m:.3f} s)" for s, what, v, m in outliers) or "- none")
    median = statistics.median(settled) if settled else None
    return {"steps": result, "median_step_seconds": median, "outliers": [list(o) for o in outliers]}


def find_outliers(timeline: Timeline, steps: list[int]) -> list[tuple[int, str, float, float]]:
    settled = [s for s in steps if s >= 2]
    names = {name for s in settled for name in timeline.seconds[s] if name not in PARENTS}
    found = []
    for name in sorted(names):
        values = [timeline.seconds[s].get(name, 0.0) for s in settled]
        median = statistics.median(values)
        found += [(s, name, v, median) for s, v in zip(settled, values, strict=True) if v - median > OUTLIER_SECONDS]
    return sorted(found, key=lambda o: -(o[2] - o[3]))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = sys.argv[1:] if argv is None else argv
    own, fit_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="optimizer steps to run (default 10)")
    parser.add_argument(
        "--gc",
        choices=("freeze", "default"),
        default="freeze",
        help="freeze: as the strategy does (gc.freeze before the first step); default: CPython's collector as is",
    )
    parser.add_argument(
        "--sync",
        choices=("hooks", "steps", "none"),
        default="hooks" if torch.cuda.is_available() else "none",
        help="torch.cuda.synchronize() around every timed call (default on CUDA), at step boundaries only, or never",
    )
    args = parser.parse_args(own)
    logging.getLogger("lightning.pytorch").setLevel(logging.INFO)  # the run's own lines (common.py quiets them)
    from pl_lowprec.cli import build_cli
    from pl_lowprec.strategies import transform_hooks

    print(f"# Step timeline\n\n{describe_machine(machine_info())}\nfit {' '.join(fit_args)}\n", flush=True)
    timeline = Timeline(args.sync)
    if args.gc == "default":  # the strategy's freeze off: CPython's full collections walk every object
        transform_hooks.freeze_long_lived_objects = lambda: None
    sys.argv = sys.argv[:1]  # the fit arguments go to LightningCLI as args, not from the command line
    cli = build_cli([*fit_args, f"--trainer.max_steps={args.steps}"], run=False)
    trainer = cli.trainer
    trainer.profiler = TimelineProfiler(timeline)
    trainer.callbacks.append(StepBoundaries(timeline))
    time_loggers(trainer, timeline)
    collector = time_garbage_collection(timeline)
    try:
        trainer.fit(cli.model, datamodule=cli.datamodule)
    finally:
        gc.callbacks.remove(collector)
    objects, frozen = timeline.objects
    print(
        f"\nsynchronize: {args.sync}; gc: {args.gc} (at the first step {objects:,} objects in the collector's"
        f" generations, {frozen:,} frozen); seconds per optimizer step (steps from 0)\n"
    )
    return report(timeline)


if __name__ == "__main__":
    main()
