"""The exception guards' answer belongs to one failure: a trainer that failed once and fails again, before its
callbacks' ``setup`` (which forgets the earlier answer), asks again."""

import signal
import warnings

import pytest
import torch.distributed as dist
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from lightning_helpers import quiet_trainer
from resume_helpers import Failure, UpdateRaisesHalfway

from pl_lowprec import LowPrecisionStrategy
from pl_lowprec.distributed import failing_ranks


class FailsAtBatch5ThenInPrepareData(UpdateRaisesHalfway):
    """Fails at batch 5 (inside its update where ``failing_batch`` is 5, else in ``on_train_batch_start``); a
    second fit's module (``in_prepare_data``) fails in ``prepare_data``, before any callback's ``setup``."""

    def __init__(self, in_prepare_data: bool = False) -> None:
        super().__init__()
        self.in_prepare_data = in_prepare_data

    def prepare_data(self):
        if self.in_prepare_data:
            raise Failure("prepare_data")

    def on_train_batch_start(self, batch, batch_idx):
        if self.failing_batch is None and self.trainer.fit_loop.total_batch_idx == 5:
            raise Failure("at batch 5")


@pytest.mark.parametrize(
    ("ranks", "first_failure"),
    [
        (1, "inside the update"),  # the first failure's "interrupted update" kept the second's file from being written
        (2, "on every rank"),  # the first failure's "every rank raised" saved where rank 1 had not: a hang
    ],
)
def test_a_failure_before_setup_on_a_trainer_that_failed_before_asks_the_ranks_again(
    tmp_path, monkeypatch, fresh_flags, ranks, first_failure
):
    """Fit 1 fails at batch 5; fit 2, on the same trainer, fails in ``prepare_data``. The guards' answer and step of
    fit 1 were forgotten only where a run's callbacks ``setup`` or a batch started: fit 2's ``OnExceptionCheckpoint``
    took fit 1's answer. On one rank: "interrupted inside the optimizer's step", so no file and a paragraph about
    fit 1's batch. On two (rank 1 saying it failed in fit 1, not in fit 2): a save where rank 1 goes on, which
    waits in the save's collectives until the process group's timeout."""
    asked = []
    if ranks == 2:  # rank 0's side, in a one-process gloo group, the store's answers scripted: rank 1 is not here

        def rank_1_fails_only_at_first(place, update_interrupted, wait_s):
            asked.append(place)
            return failing_ranks.RanksAtFailure(len(asked) == 1, (), wait_s)

        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
        monkeypatch.setattr(failing_ranks, "several_ranks", lambda: True)
        monkeypatch.setattr(failing_ranks, "_ask_the_store", rank_1_fails_only_at_first)
    else:
        monkeypatch.setattr(UpdateRaisesHalfway, "failing_batch", 5)
    on_exception = OnExceptionCheckpoint(tmp_path, filename="failed")
    trainer = quiet_trainer(  # its ModelCheckpoint a second guard: the first and the last guard differ
        strategy=LowPrecisionStrategy(),
        callbacks=[on_exception],
        max_steps=8,
        limit_val_batches=0,
        enable_checkpointing=True,
        default_root_dir=tmp_path / "root",
    )
    sigint = signal.getsignal(signal.SIGINT)
    try:
        with pytest.raises(Failure, match=r"at batch 5|inside the optimizer's update"):
            trainer.fit(FailsAtBatch5ThenInPrepareData())
        assert (tmp_path / "failed.ckpt").exists() is (ranks == 2)
        (tmp_path / "failed.ckpt").unlink(missing_ok=True)
        with pytest.raises(Failure, match="prepare_data"), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(FailsAtBatch5ThenInPrepareData(in_prepare_data=True))
    finally:
        signal.signal(signal.SIGINT, sigint)
        if dist.is_initialized():
            dist.destroy_process_group()
    said = [str(w.message) for w in caught if str(w.message).startswith("OnExceptionCheckpoint:")]
    if ranks == 2:
        assert len(asked) == 2  # fit 2's failure asked the ranks: rank 1 did not fail, so no file
        assert not (tmp_path / "failed.ckpt").exists()
        (paragraph,) = said
        assert paragraph.startswith("OnExceptionCheckpoint: rank 0 raised Failure at batch")
        assert "not every one of the 1 ranks raised there" in paragraph
    else:
        assert (tmp_path / "failed.ckpt").exists()  # one rank, nothing interrupted: Lightning's file
        assert not said
