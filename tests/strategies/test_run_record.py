"""A run resumed with other trainer or data settings than its checkpoint was saved with (accumulation, batch size,
precision, processes, a learning-rate schedule rebuilt from max_steps) is said in one warning before the first step,
with the old and new values and how to resume exactly; the same settings, or a longer run whose schedule goes on,
get none."""

from __future__ import annotations

import sys
import warnings
from contextlib import nullcontext
from pathlib import Path

import lightning.pytorch as pl
import pytest
import resume_helpers
import torch
import warm_python
from resume_helpers import Regression, _pairs
from torch.utils.data import DataLoader

from pl_lowprec import AMPPrecision
from pl_lowprec.callbacks import StepBoundaryCheckpoint
from pl_lowprec.data.resumable import resumable_loader
from pl_lowprec.strategies import run_record
from pl_lowprec.strategies.run_record import CHECKPOINT_KEY, changed_settings

SAID = "with other settings than that checkpoint was saved with"


class Configurable(Regression):
    """``Regression`` with its batch size, and a linear decay over ``estimated_stepping_batches`` where asked;
    ``plain``: a plain ``DataLoader`` (``resumable_loader`` refuses another batch size itself)."""

    def __init__(self, batch_size: int = 2, decay: bool = False, plain: bool = False) -> None:
        super().__init__()
        self.batch_size, self.decay, self.plain = batch_size, decay, plain

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        if not self.decay:
            return optimizer
        total = self.trainer.estimated_stepping_batches
        decay = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / total)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": decay, "interval": "step"}}

    def train_dataloader(self):
        if self.plain:
            return DataLoader(_pairs(20, 1), batch_size=self.batch_size)
        return resumable_loader(_pairs(20, 1), self.batch_size, None, self.trainer)


def fit(
    directory,
    max_steps,
    ckpt_path=None,
    accumulate=2,
    precision="32-true",
    plugins=None,
    everything=False,
    model=None,
    **kw,
):
    """The warnings that say a changed run (``everything``: all warnings); ``model`` in place of a
    ``Configurable(**kw)``."""
    trainer = pl.Trainer(
        accelerator="cpu",
        strategy="lowprec",
        accumulate_grad_batches=accumulate,
        precision=None if plugins else precision,
        plugins=plugins,
        max_steps=max_steps,
        callbacks=[StepBoundaryCheckpoint(dirpath=directory, save_last=True, every_n_train_steps=1, save_top_k=-1)],
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model or Configurable(**kw), ckpt_path=ckpt_path)
    return [str(w.message) for w in caught if everything or SAID in str(w.message)]


def test_the_checkpoint_records_the_runs_settings(tmp_path):
    fit(tmp_path, max_steps=2)
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)[CHECKPOINT_KEY]
    assert saved == {
        "accumulate_grad_batches": 2,
        "world_size": 1,
        "batch_size": 2,
        "seq_len": None,  # no data module with one
        "precision": "32-true",
        "max_steps": 2,
    }


def test_the_same_settings_and_a_longer_run_without_schedule_resume_without_a_word(tmp_path):
    fit(tmp_path, max_steps=2)
    assert fit(tmp_path, max_steps=4, ckpt_path=tmp_path / "last.ckpt") == []


def test_other_accumulation_batch_size_and_precision_are_said_with_the_saved_values(tmp_path):
    fit(tmp_path, max_steps=2, plain=True)
    said = fit(tmp_path, 4, tmp_path / "last.ckpt", accumulate=4, precision="bf16-mixed", batch_size=1, plain=True)
    assert len(said) == 1, said
    paragraph = said[0]
    assert paragraph.startswith(f"This run resumes from {tmp_path / 'last.ckpt'} at step 2 {SAID}")
    assert "accumulate_grad_batches 2 -> 4: each optimizer step sums another number of micro-batches" in paragraph
    assert "batch_size 2 -> 1: each micro-batch holds another number of rows" in paragraph
    assert "precision 32-true -> bf16-mixed: the steps compute in another precision" in paragraph
    assert "\n" not in paragraph  # one paragraph
    assert (
        "To resume exactly, run with the saved values (trainer.accumulate_grad_batches=2, the training loader's"
        " batch_size=2, trainer.precision=32-true). If the change is meant, it trains on as set."
    ) in paragraph


def test_a_schedule_rebuilt_from_a_raised_max_steps_is_said_with_the_learning_rates(tmp_path):
    fit(tmp_path, max_steps=2, decay=True)  # lr 0.1 * (1 - 2/2) at its end
    said = fit(tmp_path, 4, tmp_path / "last.ckpt", decay=True)  # rebuilt: 0.1 * (1 - 2/4)
    assert len(said) == 1, said
    assert "max_steps 2 -> 4, the learning rate at step 2: 0 -> 0.05" in said[0]
    assert said[0].endswith(
        "A schedule built from max_steps keeps the saved run's rates only at its saved max_steps (2): to train"
        " longer on one schedule, start anew with the longer max_steps. If the change is meant, it trains on as set."
    )


def test_another_number_of_processes_is_a_change():
    saved = {"world_size": 2, "precision": "bf16-mixed", "seq_len": None}
    now = {"world_size": 1, "precision": "bf16-mixed", "seq_len": 128}
    assert changed_settings(saved, now) == [
        "world_size 2 -> 1: another number of processes: another global batch, each process another shard of the"
        " data, and the saved per-process random states are not restored (dropout masks and shuffles start anew)"
    ]


def test_a_precision_change_that_amp_precision_says_itself_is_not_said_twice(tmp_path):
    fit(tmp_path, max_steps=2, plugins=[AMPPrecision("bf16-mixed")])
    said = fit(tmp_path, 4, tmp_path / "last.ckpt", accumulate=4, plugins=[AMPPrecision("16-mixed")], everything=True)
    assert len([s for s in said if s.startswith("This checkpoint was trained with precision 'bf16-mixed'")]) == 1
    (changed,) = [s for s in said if SAID in s]
    assert "accumulate_grad_batches 2 -> 4" in changed and "precision bf16-mixed -> 16-mixed" not in changed


class Cosine(Configurable):
    """``Configurable`` with a torch scheduler whose length is ``max_steps``: its state saves that length."""

    def __init__(self, scheduler: str = "cosine") -> None:
        super().__init__()
        self.scheduler = scheduler

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        steps = self.trainer.max_steps
        if self.scheduler == "cosine":
            schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=steps)
        else:
            schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


@pytest.mark.parametrize(
    ("scheduler", "argument"), [("cosine", "CosineAnnealingLR T_max"), ("one_cycle", "OneCycleLR total_steps")]
)
def test_a_scheduler_that_keeps_its_saved_length_over_a_raised_max_steps_is_said(
    tmp_path, monkeypatch, scheduler, argument
):
    """torch restores ``T_max`` / ``total_steps`` from the checkpoint over the ones ``configure_optimizers`` built
    from the raised ``max_steps``: the run follows the saved schedule (a cosine climbs back up after it, OneCycleLR
    fails past it), which the warning says before the first step, with both values and the fix."""
    said = []
    monkeypatch.setattr(run_record, "rank_zero_warn", said.append)  # kept where OneCycleLR's error ends the fit
    fit(tmp_path, max_steps=2, model=Cosine(scheduler))
    failing = pytest.raises(ValueError, match="Tried to step 3 times") if scheduler == "one_cycle" else nullcontext()
    with failing:
        fit(tmp_path, 4, tmp_path / "last.ckpt", model=Cosine(scheduler))
    assert len(said) == 1, said
    assert (
        f"max_steps 2 -> 4, the restored scheduler keeps the checkpoint's arguments, not those configure_optimizers"
        f" built for this run: {argument}=2 (this run built 4); the saved schedule goes on" in said[0]
    )
    assert "start anew with the longer max_steps" in said[0]


def test_a_scheduler_resumed_with_its_saved_length_is_not_said(tmp_path):
    fit(tmp_path, max_steps=4, model=Cosine())
    assert fit(tmp_path, 4, tmp_path / "epoch=0-step=2.ckpt", model=Cosine()) == []


def test_another_number_of_processes_is_said_end_to_end(tmp_path):
    """1 process -> 2 DDP ranks (gloo) and 2 -> 1: the checkpoint records the world size, and the resumed fit says
    the change once (on rank 0 only), with the saved value to resume exactly with."""
    checkpoints = tmp_path / "one"
    resume_helpers.fit(checkpoints, strategy="lowprec", max_steps=5, plain_loader=True)  # an epoch
    script = Path(__file__).parents[1] / "_scripts" / "run_record_ddp.py"
    run = [sys.executable, str(script), str(checkpoints / "last.ckpt"), str(tmp_path)]
    result = warm_python.run(run, 120, ranks=2, pythonpath=script.parents[1])
    assert result.returncode == 0, result.stderr[-4000:]
    said = (tmp_path / "said0.txt").read_text()
    assert said.startswith(f"This run resumes from {checkpoints / 'last.ckpt'} at step 5 {SAID}")
    assert "world_size 1 -> 2: another number of processes" in said and "trainer.devices x trainer.num_nodes=1" in said
    assert (tmp_path / "said1.txt").read_text() == ""  # rank_zero_warn: one warning, not one a rank

    two_processes = tmp_path / "two/last.ckpt"  # the 2 ranks' run, saved at its end
    assert torch.load(two_processes, weights_only=True)[CHECKPOINT_KEY]["world_size"] == 2
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resume_helpers.fit(
            tmp_path / "one", strategy="lowprec", ckpt_path=two_processes, max_steps=7, plain_loader=True
        )
    (said,) = [str(w.message) for w in caught if SAID in str(w.message)]
    assert "world_size 2 -> 1: another number of processes" in said
    assert "To resume exactly, run with the saved values (trainer.devices x trainer.num_nodes=2)" in said
