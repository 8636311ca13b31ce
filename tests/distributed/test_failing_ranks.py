"""save_on_exception on 2 DDP CPU processes (gloo) where one rank raises alone: a message and an exit, never a
hang; where every rank raises at the same batch, the exception's checkpoint."""

import re
import sys
import time
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
@pytest.mark.parametrize("failing", ["1", "0"])
def test_a_rank_that_raises_alone_saves_nothing_and_says_so_instead_of_hanging(tmp_path, failing):
    """The save gathers every rank's random states and ends in a barrier: the failing rank waited in them for a
    rank that trained on into its gradients' all-reduce, both until the process group's 30-minute timeout."""
    result = _run(tmp_path, failing)
    assert result.returncode != 0
    said = f"save_on_exception: rank {failing} raised Failure at batch 0 of epoch 1 (global step 3), and not every"
    assert said in result.stderr, result.stderr[-4000:]
    assert f"The run's last checkpoint stays {tmp_path / 'last.ckpt'}; resume from it." in result.stderr
    assert torch.load(tmp_path / "last.ckpt", weights_only=False)["global_step"] == 2


@pytest.mark.slow
def test_ranks_that_raise_at_the_same_batch_save_the_exceptions_checkpoint(tmp_path):
    result = _run(tmp_path, "0,1")
    assert result.returncode != 0 and "save_on_exception" not in result.stderr, result.stderr[-4000:]
    saved = torch.load(tmp_path / "last.ckpt", weights_only=False)
    assert saved["global_step"] == 3 and len(saved["pl_lowprec_random_states"]) == 2


@pytest.mark.slow
def test_rank_zero_that_raises_alone_under_lightnings_launcher_stops_rank_one_instead_of_waiting(tmp_path):
    """Rank 0 raised alone; rank 1, which Lightning's launcher started, waited in its gradients' all-reduce for it,
    and rank 0 waited LAUNCHED_RANKS_WAIT_S (120 s) at exit for rank 1 before it ended. It now waits 10 s and
    kills rank 1, as torchrun's agent stops the other workers when one fails."""
    command = [sys.executable, str(SCRIPT), str(tmp_path), "0"]
    result = warm_python.run(command, 300, pythonpath=SCRIPT.parents[1])  # rank 0; Lightning starts rank 1
    ended = time.time()
    raised = float(re.search(r"rank 0 raised at (\S+)", result.stderr)[1])
    assert ended - raised < 60, result.stderr[-4000:]  # the store's 5 s, 10 s for rank 1, then the kill
    assert "save_on_exception: rank 0 raised Failure at batch 0 of epoch 1" in result.stderr
    assert "stopped rank 1 (SIGKILL)" in result.stderr
    assert result.returncode == 1  # rank 0's own


@pytest.mark.slow
def test_lightnings_on_exception_checkpoint_where_a_rank_raises_alone_saves_nothing_and_says_so(tmp_path):
    """Lightning's ``OnExceptionCheckpoint`` hung both ranks the same way (its save's collectives); under the
    package's strategies it becomes one that asks the other ranks first."""
    result = _run(tmp_path, "1", "OnExceptionCheckpoint")
    assert result.returncode != 0
    said = "OnExceptionCheckpoint: rank 1 raised Failure at batch 0 of epoch 1 (global step 3), and not every one"
    assert said in result.stderr, result.stderr[-4000:]
    assert f"The run's last checkpoint stays {tmp_path / 'last.ckpt'}; resume from it." in result.stderr
    assert not (tmp_path / "on_exception.ckpt").exists()


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
