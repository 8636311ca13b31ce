"""Loss scale, skipped steps and memory figures reach every Lightning logger at Lightning's logger step: one per
batch that stepped (under gradient accumulation, one per window; with two manual optimizers, one per batch).

The end-of-stage figures (``loss_scale/final/*``, ``memory/*``) went to ``global_step - 1`` and ``global_step``:
steps 7 and 8 with two optimizers, after a per-step series that ended at step 3."""

import csv
from collections import defaultdict

import pytest
import torch
from lightning.pytorch.loggers import CSVLogger, Logger, TensorBoardLogger
from lightning_helpers import Classifier, TwoOptimizers, mlp_batches, quiet_trainer
from plain_amp_loop import make_mlp

from pl_lowprec import AMPPrecision, LossScaleMonitor, MemoryTracker

Series = dict[str, list[tuple[int, float]]]


class RecordingLogger(Logger):
    """A logger of no known kind: what reaches ``log_metrics`` is what any logger receives."""

    def __init__(self) -> None:
        super().__init__()
        self.series: Series = defaultdict(list)

    name, version = "recording", 0

    def log_metrics(self, metrics, step=None) -> None:
        for key, value in metrics.items():
            self.series[key].append((step, float(value)))

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass


def _csv(logger: CSVLogger) -> Series:
    series: Series = defaultdict(list)
    with open(f"{logger.log_dir}/metrics.csv") as f:
        for row in csv.DictReader(f):
            for key, value in row.items():
                if value and key != "step":
                    series[key].append((int(row["step"]), float(value)))
    return series


def _tensorboard(logger: TensorBoardLogger) -> Series:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _logger(kind: str, tmp_path):
    if kind == "csv":
        return CSVLogger(tmp_path), _csv
    if kind == "tensorboard":
        pytest.importorskip("tensorboard", reason="TensorBoardLogger writes and reads through tensorboard")
        return TensorBoardLogger(tmp_path), _tensorboard
    recording = RecordingLogger()
    return recording, lambda logger: logger.series


RUNS = {
    # 8 batches in windows of 2: 4 optimizer steps, the second skipped.
    "accumulate_2": (lambda: Classifier(make_mlp(), overflow_at_steps=(1,)), {"accumulate_grad_batches": 2}, 4, 1),
    # 4 batches, two optimizers each (global_step 8), both skipped on batch 1.
    "two_optimizers": (lambda: TwoOptimizers(make_mlp(), overflow_at_batches=(1,)), {}, 8, 2),
}


@pytest.mark.parametrize("kind", ["csv", "tensorboard", "any"])
@pytest.mark.parametrize("run", RUNS.values(), ids=RUNS.keys())
def test_figures_arrive_in_the_logger_at_the_step_of_the_batch_that_stepped(kind, run, tmp_path):
    module, trainer_kwargs, max_steps, skipped = run
    logger, read = _logger(kind, tmp_path)
    tracker = MemoryTracker(print_summary=False)
    trainer = quiet_trainer(
        plugins=[AMPPrecision("16-mixed", init_scale=1024.0)],
        max_steps=max_steps,
        callbacks=[LossScaleMonitor(print_summary=False), tracker],
        logger=logger,
        log_every_n_steps=1,
        **trainer_kwargs,
    )
    trainer.fit(module(), mlp_batches(8))
    assert trainer.global_step == max_steps
    series = read(logger)

    assert series["loss_scale/scale"] == [(0, 1024.0), (1, 512.0), (2, 512.0), (3, 512.0)]
    assert series["loss_scale/skipped_steps"] == [(0, 0.0), (1, skipped), (2, skipped), (3, skipped)]
    assert series["loss_scale/final/skipped_steps"] == [(3, skipped)]
    assert series["loss_scale/final/scale"] == [(3, 512.0)]
    memory = {key.removeprefix("memory/fit/"): points for key, points in series.items() if key.startswith("memory/")}
    assert memory.keys() == tracker.summary["fit"]["bytes"].keys()
    for key, nbytes in tracker.summary["fit"]["bytes"].items():
        # TensorBoard stores float32: bytes past 2**24 are rounded to its precision there
        assert memory[key] == [(3, float(torch.tensor(float(nbytes)).item() if kind == "tensorboard" else nbytes))]
