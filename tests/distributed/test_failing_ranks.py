"""save_on_exception on 2 DDP CPU processes (gloo) where one rank raises alone: a message and an exit, never a
hang; where every rank raises at the same batch, the exception's checkpoint."""

import sys
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import warm_python

from pl_lowprec.distributed.failing_ranks import every_rank_wait_s

SCRIPT = Path(__file__).parents[1] / "_scripts" / "exception_ddp.py"


def _run(out: Path, ranks: str, *saved_by: str):
    command = [sys.executable, str(SCRIPT), str(out), ranks, *saved_by]
    return warm_python.run(command, 120, ranks=2, pythonpath=SCRIPT.parents[1])  # TimeoutExpired: a hang


@pytest.mark.slow
@pytest.mark.parametrize(
    ("failing", "saved_by"), [("1", "save_on_exception,OnExceptionCheckpoint"), ("0", "save_on_exception")]
)
def test_a_rank_that_raises_alone_saves_nothing_and_says_so_instead_of_hanging(tmp_path, failing, saved_by):
    """The save gathers every rank's random states and ends in a barrier: the failing rank waited in them for a
    rank that trained on into its gradients' all-reduce, both until the process group's 30-minute timeout.
    Lightning's ``OnExceptionCheckpoint`` hung both ranks the same way (its save's collectives); under the
    package's strategies it becomes one that asks the other ranks first, and with ``save_on_exception`` beside it
    the ranks are asked once (a second ask would wait for them again)."""
    result = _run(tmp_path, failing, saved_by)
    assert result.returncode != 0
    for callback in saved_by.split(","):
        said = f"{callback}: rank {failing} raised Failure at batch 0 of epoch 1 (global step 3), and not every"
        assert said in result.stderr, result.stderr[-4000:]
    assert f"The run's last checkpoint stays {tmp_path / 'last.ckpt'}; resume from it." in result.stderr
    assert result.stderr.count(f"rank {failing} asks the other ranks") == 1
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == 2
    assert not (tmp_path / "on_exception.ckpt").exists()


@pytest.mark.slow
def test_ranks_that_raise_at_the_same_batch_save_the_exceptions_checkpoint(tmp_path):
    result = _run(tmp_path, "0,1")
    assert result.returncode != 0 and "save_on_exception" not in result.stderr, result.stderr[-4000:]
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert saved["global_step"] == 3 and len(saved["pl_lowprec_random_states"]) == 2


@pytest.mark.slow
def test_where_one_ranks_update_was_interrupted_no_rank_saves(tmp_path):
    """Rank 1's optimizer raised halfway through its update, rank 0 raised before its own at the same batch:
    rank 1 writes no file, and rank 0 must not enter the save's collectives without it (it would hang)."""
    result = _run(tmp_path, "0", "save_on_exception", "1")
    assert result.returncode != 0
    said = (
        "save_on_exception: Failure was raised inside the optimizer's step on rank 1, after it had begun updating the"
        " parameters, at batch 1 of epoch 1 (global step 3)"
    )
    assert result.stderr.count(said) == 2, result.stderr[-4000:]  # said by both ranks
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == 2


def test_the_wait_is_the_callbacks_else_a_minute_capped_at_the_process_groups_timeout():
    def trainer(timeout):
        return SimpleNamespace(strategy=SimpleNamespace(_timeout=timeout))

    assert every_rank_wait_s(trainer(timedelta(minutes=30))) == 60.0  # Lightning's default timeout
    assert every_rank_wait_s(trainer(timedelta(seconds=20))) == 20.0  # a rank waits no longer in a collective
    assert every_rank_wait_s(SimpleNamespace(strategy=SimpleNamespace())) == 60.0  # one device: no group
    assert every_rank_wait_s(trainer(timedelta(seconds=20)), 300) == 300.0  # StepBoundaryCheckpoint's own
