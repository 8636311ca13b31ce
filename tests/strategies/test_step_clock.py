"""At the end of ``fit``, the run's own median optimizer step beside the step time predicted before loading."""

import dataclasses
import itertools
import statistics
import time

import lightning.pytorch as pl
import pytest
from lightning_helpers import quiet_trainer
from qlora_helpers import ids_loader, tiny_llama

import pl_lowprec.strategies.auto_settings as auto_settings
from pl_lowprec import LowPrecisionStrategy
from pl_lowprec.memory.step_time import StepTime
from pl_lowprec.strategies.step_clock import StepClock

pytest.importorskip("peft")
LORA = {"r": 4, "lora_alpha": 8}
GiB = 2**30


def test_the_durations_start_at_the_third_step_and_the_median_is_theirs():
    clock = StepClock(ends=[0.0, 1.0, 3.0, 6.0, 10.0, 100.0])  # steps 1-6 ended at these times
    assert clock.durations == [2.0, 3.0, 4.0, 90.0]  # steps 3-6: the first two warm up
    assert clock.median == 3.5  # the 90 s step (a checkpoint saved) does not move it
    assert StepClock(ends=[0.0, 1.0]).median is None


def test_the_clock_stands_still_while_paused():
    clock = StepClock()
    clock.tick()
    clock.pause()
    time.sleep(0.2)  # a validation
    clock.resume()
    clock.resume()  # a second resume adds nothing
    clock.tick()
    assert clock.paused >= 0.2 and clock.ends[1] - clock.ends[0] < 0.1


class SlowValidation(pl.Callback):
    """Validation that takes 0.3 s a batch, inside the strategy's on_validation_start/end."""

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        time.sleep(0.3)


def test_the_steps_after_which_the_run_validated_count_their_own_time_only(monkeypatch):
    monkeypatch.setattr(auto_settings, "available_memory", lambda device: 64 * GiB)
    built = LowPrecisionStrategy(lora=LORA, memory_saving="auto", activation_checkpointing="auto")
    times = OptimizerStepTimes()
    trainer = quiet_trainer(
        strategy=built,
        precision="bf16-mixed",
        max_steps=6,
        val_check_interval=2,
        limit_val_batches=1,
        num_sanity_val_steps=0,
        callbacks=[times, SlowValidation()],
    )
    loader = ids_loader(batches=12, batch_size=2, seq_len=32)
    trainer.fit(tiny_llama(), loader, ids_loader(batches=1, batch_size=2, seq_len=32))
    own = [later - earlier for earlier, later in itertools.pairwise(times.starts[1:])]
    assert sum(d > 0.3 for d in own) == 2  # steps 3 and 5 began after a validation (after steps 2 and 4)
    assert max(built.step_clock.durations) < 0.3, built.step_clock.durations
    assert built.step_clock.paused >= 3 * 0.3  # after steps 2, 4 and 6


def test_a_prediction_timed_beside_busy_processes_says_so():
    predicted = StepTime("this CPU (2 threads, measured)", 0.02, 0.01, 0.01, 0.0, 700, 10**9, 10**8)
    ends = [0.0, 1.0, 1.1, 1.2]
    assert "busy" not in StepClock(predicted, ends).line()
    busy = StepClock(dataclasses.replace(predicted, timed_kernels=600, one_thread_kernels=40), ends)
    assert busy.line().endswith(
        " Other processes kept this CPU's cores busy as it predicted: 40 kernels were timed on one thread (an upper"
        " bound on the idle machine's time), and the run shared the cores with them."
    )


def test_where_fresh_pages_are_a_tenth_of_the_prediction_the_end_line_says_how_to_keep_freed_blocks():
    predicted = StepTime("this CPU (2 threads, measured)", 2.0, 1.0, 0.5, 0.0, 700, 10**9, 10**8)
    ends = [0.0, 1.0, 3.2, 5.4]
    assert "fresh pages" not in StepClock(dataclasses.replace(predicted, fresh_pages=0.19), ends).line()
    line = StepClock(dataclasses.replace(predicted, fresh_pages=0.5, fresh_bytes=2**30), ends).line()
    assert line.endswith(
        " The OS's first writes to fresh pages were 0.500 s (25%) of the prediction: start Python with"
        " MALLOC_MMAP_MAX_=0 MALLOC_TRIM_THRESHOLD_=68719476736 to keep freed blocks for reuse (faster; the process"
        " keeps more resident memory, docs/memory.md)."
    )


def test_a_prediction_across_ranks_names_its_collectives():
    predicted = StepTime("this CPU (1 thread, measured)", 2.0, 1.0, 0.5, 0.0, 700, 10**9, 10**8)
    ends = [0.0, 1.0, 3.2, 5.4]
    assert "collectives" not in StepClock(predicted, ends).line()
    ranks = dataclasses.replace(predicted, communication=0.068, collectives=5, interconnect="gloo between 2 ranks")
    assert "predicted before loading: 2.000 s on this CPU (1 thread, measured), 0.068 s of it collectives on gloo" in (
        StepClock(ranks, ends).line()
    )


class OptimizerStepTimes(pl.Callback):
    """When each optimizer step starts, taken apart from the strategy's clock."""

    def __init__(self) -> None:
        self.starts: list[float] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.starts.append(time.perf_counter())


@pytest.mark.parametrize(
    ("strategy", "predicted"),
    [
        ({"memory_saving": "auto", "activation_checkpointing": "auto"}, True),
        ({"memory_saving": False, "memory_budget": "8GiB"}, True),
        ({"memory_saving": False}, False),  # nothing was predicted, so nothing to compare
    ],
    ids=["auto settings", "memory_budget", "explicit settings"],
)
def test_fit_sets_its_median_step_beside_the_prediction(caplog, monkeypatch, strategy, predicted):
    monkeypatch.setattr(auto_settings, "available_memory", lambda device: 64 * GiB)
    built = LowPrecisionStrategy(lora=LORA, **strategy)
    times = OptimizerStepTimes()
    trainer = quiet_trainer(
        strategy=built, precision="bf16-mixed", max_steps=6, accumulate_grad_batches=2, callbacks=[times]
    )
    with caplog.at_level("INFO"):
        trainer.fit(tiny_llama(), ids_loader(batches=12, batch_size=2, seq_len=32))
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Step time of this run")]
    if not predicted:
        assert built.prediction is None and lines == []
        assert built.step_clock is None  # nothing to compare with, so the steps are not timed
        return
    # 6 optimizer steps of 2 micro-batches: steps 3-6 timed, each from the end of the one before
    own = [later - earlier for earlier, later in itertools.pairwise(times.starts[1:])]
    assert len(built.step_clock.durations) == len(own) == 4
    assert built.step_clock.median == pytest.approx(statistics.median(own), rel=0.1, abs=2e-3)
    seconds = built.prediction.step_time.seconds
    assert lines == [
        f"Step time of this run: {built.step_clock.median:.3f} s per optimizer step (the median of 4 steps from step"
        f" 3 on); predicted before loading: {seconds:.3f} s on {built.prediction.step_time.device}, so the run took"
        f" {built.step_clock.median / seconds:.2f}x the prediction. The prediction counts the step's kernels and"
        " their dispatch; the run's time also holds the Python around them (the model's modules, autograd), the data"
        " loader, Lightning's loop and logging."
    ]
