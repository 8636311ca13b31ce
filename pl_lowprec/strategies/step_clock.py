"""The run's own step time beside the one predicted before it loaded.

The ``"auto"`` settings and ``memory_budget=`` predict one optimizer step's time (``memory/step_time.py``) before
anything loads, and the log says it. A prediction that misses should show in the user's own run, not only in a
benchmark: ``StepClock`` takes the wall time between consecutive optimizer steps, and at the end of ``fit`` one line
sets their median beside the prediction.

- From the third optimizer step on: the first creates the optimizer state (and, with ``compile=``, compiles), the
  second may still be warming up caches.
- No device synchronisation, so timing costs the run nothing: in a steady state the host waits for the device once
  per step anyway, so the interval between two steps is one step's time.
- The clock stops while the run validates (the strategy's ``on_validation_start``/``on_validation_end``), so a
  step after which the run validated counts its own time only: with ``val_check_interval`` near the timed steps'
  count, half of them held a validation and moved the median (a 6-step fit read 13.7 s a step for 6.2).
- The median leaves out the steps that save a checkpoint or log more than usual.
- What is measured includes what the prediction leaves out (it counts the step's kernels and their dispatch): the
  Python around the kernels (the model's modules, autograd), the data loader, Lightning's loop and logging. The
  line says so. In a short step they are a large share: the quickstart's plain loop took 1.28-1.44x its
  prediction and fit 1.09-1.16x the plain loop (``benchmarks/fit_vs_plain_loop.py``, 4 runs on a 2-core EPYC).
"""

from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass, field

from pl_lowprec.memory.step_time import StepTime

FIRST_TIMED_STEP = 3  # the first creates the optimizer state (and compiles); the second may still warm caches


@dataclass
class StepClock:
    """When each optimizer step ended (``time.perf_counter`` less the time paused), in order, and the step time
    predicted for them."""

    predicted: StepTime | None = None
    ends: list[float] = field(default_factory=list)
    paused: float = 0.0  # seconds the clock stood still (validation), left out of every later end
    _paused_at: float | None = None

    def tick(self) -> None:
        """Called once per optimizer step, after it."""
        self.ends.append(time.perf_counter() - self.paused)

    def pause(self) -> None:
        """Stop the clock (validation starts)."""
        self._paused_at = time.perf_counter()

    def resume(self) -> None:
        """Run it again (validation ended); a resume without a pause does nothing."""
        if self._paused_at is not None:
            self.paused += time.perf_counter() - self._paused_at
            self._paused_at = None

    @property
    def durations(self) -> list[float]:
        """The seconds of each optimizer step from ``FIRST_TIMED_STEP`` on: the time since the step before ended."""
        return [later - earlier for earlier, later in itertools.pairwise(self.ends[FIRST_TIMED_STEP - 2 :])]

    @property
    def median(self) -> float | None:
        """The median of ``durations``; ``None`` when the run made fewer than ``FIRST_TIMED_STEP`` steps."""
        return statistics.median(self.durations) if self.durations else None

    def line(self) -> str | None:
        """One line: the measured median beside the prediction and their ratio; ``None`` with nothing to compare."""
        measured, predicted = self.median, self.predicted
        if measured is None or predicted is None or predicted.seconds <= 0:
            return None
        count = len(self.durations)
        steps = (
            f"the median of {count} steps from step {FIRST_TIMED_STEP} on" if count > 1 else f"step {FIRST_TIMED_STEP}"
        )
        return (
            f"Step time of this run: {measured:.3f} s per optimizer step ({steps}); predicted before loading:"
            f" {predicted.seconds:.3f} s on {predicted.device}{_collectives_part(predicted)}, so the run took"
            f" {measured / predicted.seconds:.2f}x the prediction. The prediction counts the step's kernels and their"
            f" dispatch; the run's time also holds the Python around them (the model's modules, autograd), the data"
            f" loader, Lightning's loop and logging.{_busy_part(predicted)}"
            f"{_fresh_pages_part(predicted)}"
        )


def _collectives_part(predicted: StepTime) -> str:
    """The collectives' share of the prediction, where a run across ranks timed them."""
    if not predicted.communication:
        return ""
    return f", {predicted.communication:.3f} s of it collectives on {predicted.interconnect}"


def _fresh_pages_part(predicted: StepTime) -> str:
    """Where the OS's first writes to fresh pages are a large part of the prediction: how to keep freed blocks
    (``step_time.KEEP_FREED_BLOCKS``), said where the run ends, as ``estimate`` says it before."""
    hint = predicted.keep_freed_blocks_hint()
    if hint is None:
        return ""
    share = predicted.fresh_pages / predicted.seconds
    return (
        f" The OS's first writes to fresh pages were {predicted.fresh_pages:.3f} s ({share:.0%}) of the prediction:"
        f" {hint} (faster; the process keeps more resident memory, docs/memory.md)."
    )


def _busy_part(predicted: StepTime) -> str:
    """Where the prediction timed kernels while other processes held the cores, which the run shared too."""
    count = predicted.one_thread_kernels
    if not count:
        return ""
    return (
        f" Other processes kept this CPU's cores busy as it predicted: {count:,} kernels were timed on one thread"
        " (an upper bound on the idle machine's time), and the run shared the cores with them."
    )
