"""A run resumed inside an epoch on a plain ``DataLoader`` (no ``state_dict``) draws the rest of the epoch from a
new shuffle: the strategies say so with the numbers and the loader that fixes it, in place of Lightning's general
warning; a loader that resumes, or a checkpoint where an epoch ended, gets no warning."""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
from resume_helpers import Regression, _pairs
from torch.utils.data import DataLoader

from pl_lowprec.callbacks import StepBoundaryCheckpoint


class PlainLoaderRegression(Regression):
    def train_dataloader(self):
        return DataLoader(_pairs(20, 1), batch_size=2, shuffle=True)  # 10 batches, 5 steps accumulating 2


def fit(directory, module_class, max_steps, ckpt_path=None):
    trainer = pl.Trainer(
        accelerator="cpu",
        strategy="lowprec",
        accumulate_grad_batches=2,
        max_steps=max_steps,
        callbacks=[StepBoundaryCheckpoint(dirpath=directory, save_last=True, every_n_train_steps=1, save_top_k=-1)],
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module_class(), ckpt_path=ckpt_path)
    return [str(w.message) for w in caught]


def resumption_warnings(said):
    return [s for s in said if "resum" in s and "epoch" in s]


def test_a_plain_loader_resumed_inside_an_epoch_is_said_with_the_fix(tmp_path):
    fit(tmp_path, PlainLoaderRegression, max_steps=2)
    said = resumption_warnings(fit(tmp_path, PlainLoaderRegression, max_steps=4, ckpt_path=tmp_path / "last.ckpt"))
    assert len(said) == 1, said  # ours, in place of Lightning's "You're resuming from a checkpoint that ended ..."
    assert said[0].startswith(
        "This run resumes at step 2, inside epoch 0 (4 of its 10 batches done), but the training loader (DataLoader"
        " with RandomSampler) has no state to resume from"
    )
    assert "(a new shuffle)" in said[0] and "pl_lowprec.data.resumable_loader(dataset, batch_size," in said[0]


def test_no_warning_where_the_loader_resumes_or_the_epoch_had_ended(tmp_path):
    fit(tmp_path / "resumable", Regression, max_steps=2)  # resumable_loader
    assert not resumption_warnings(
        fit(tmp_path / "resumable", Regression, max_steps=4, ckpt_path=tmp_path / "resumable/last.ckpt")
    )
    fit(tmp_path / "ended", PlainLoaderRegression, max_steps=5)  # the epoch's 10 batches: 5 steps
    assert not resumption_warnings(
        fit(tmp_path / "ended", PlainLoaderRegression, max_steps=7, ckpt_path=tmp_path / "ended/last.ckpt")
    )
