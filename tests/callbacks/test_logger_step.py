"""End-of-stage figures land at Lightning's logger step, next to the per-step series, not at global_step."""

import csv

import torch
from lightning.pytorch.loggers import CSVLogger
from lightning_helpers import TwoOptimizers, quiet_trainer
from plain_amp_loop import make_classification_data, make_mlp

from pl_lowprec import AMPPrecision, LossScaleMonitor, MemoryTracker


def test_final_and_memory_figures_land_at_the_last_logged_step_with_two_optimizers(tmp_path):
    """They went to global_step - 1 and global_step: 7 and 8 after a series that ended at step 3."""
    loader = torch.utils.data.DataLoader(make_classification_data(n=32), batch_size=8)
    trainer = quiet_trainer(
        plugins=[AMPPrecision("16-mixed")],
        max_steps=8,
        callbacks=[LossScaleMonitor(print_summary=False), MemoryTracker(print_summary=False)],
        logger=CSVLogger(tmp_path),
        log_every_n_steps=1,
    )
    trainer.fit(TwoOptimizers(make_mlp()), loader)
    assert trainer.global_step == 8  # two optimizer steps on each of 4 batches
    with open(f"{trainer.logger.log_dir}/metrics.csv") as f:
        rows = list(csv.DictReader(f))

    def steps_of(metric):
        return [int(r["step"]) for r in rows if r.get(metric)]

    assert steps_of("loss_scale/scale") == [0, 1, 2, 3]
    assert steps_of("loss_scale/final/scale") == [3]
    assert steps_of("memory/fit/params_float32") == [3]
