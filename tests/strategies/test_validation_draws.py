"""A fit's validation_step draws from a stream of its own: a run resumed where Lightning skips a validation that
followed the checkpoint draws the uninterrupted run's dropout masks though the module's validation draws."""

from typing import ClassVar

import pytest
import torch
from resume_helpers import Regression, fit

from pl_lowprec import LowPrecisionStrategy


class DrawsInValidation(Regression):
    """Draws from the global generator in each ``validation_step``, as sampled generations or a stochastic metric
    do; keeps the draws."""

    draws: ClassVar[list[torch.Tensor]] = []

    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        self.draws.append(torch.rand(3))


RUN = {"max_steps": 8, "dropout": 0.5, "validate_every": 4, "module_class": DrawsInValidation}


@pytest.mark.parametrize("saved_step", [2, 4])  # saved at batch 3 and 7's end, each followed by a validation
def test_a_run_resumed_before_a_skipped_validation_draws_the_uninterrupted_masks(tmp_path, saved_step):
    """Restarted on the batch whose validation followed the checkpoint, Lightning skips it: without the module's
    validation draws, the resumed run's every later dropout mask differed from the uninterrupted run's."""
    uninterrupted = fit(tmp_path / "full", strategy=LowPrecisionStrategy(), **RUN)
    (file,) = (tmp_path / "full").glob(f"epoch=*-step={saved_step}.ckpt")
    resumed = fit(tmp_path / "resumed", strategy=LowPrecisionStrategy(), ckpt_path=file, **RUN)
    assert torch.equal(resumed, uninterrupted)


def test_a_validation_draws_what_it_drew_without_its_own_stream(tmp_path, monkeypatch):
    """The first validation's steps draw on from the generators as they stood, as under Lightning's strategy."""
    draws = {}
    for name, strategy in [("lightning", "auto"), ("pl_lowprec", LowPrecisionStrategy())]:
        monkeypatch.setattr(DrawsInValidation, "draws", [])
        fit(tmp_path / name, strategy=strategy, **{**RUN, "max_steps": 2})
        draws[name] = DrawsInValidation.draws
    assert len(draws["lightning"]) == 2
    assert torch.equal(torch.stack(draws["pl_lowprec"]), torch.stack(draws["lightning"]))
