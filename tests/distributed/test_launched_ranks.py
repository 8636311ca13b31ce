"""Rank 0 under Lightning's launcher ends with the run's status: a refusal that every rank makes exits 2, not 137
from the launcher's kill (``pl_lowprec/distributed/launched_ranks.py``)."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver

from pl_lowprec.distributed import launched_ranks


def _observer_of_a_failed_rank():
    """Lightning's observer, running, of one launched rank that exited 2; its "rank 0" a stand-in process."""
    rank_zero = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    failed = subprocess.Popen([sys.executable, "-c", "raise SystemExit(2)"])
    failed.wait()
    observer = _ChildProcessObserver(main_pid=rank_zero.pid, child_processes=[failed], sleep_period=3600)
    observer.start()  # asleep: the test runs its check itself
    return observer, rank_zero


@pytest.mark.parametrize("leaving", ["exiting", "failing", None])
def test_the_observer_spares_rank_zero_only_once_it_is_leaving(fresh_flags, leaving):
    observer, rank_zero = _observer_of_a_failed_rank()
    try:
        launched_ranks.spare_leaving_rank_zero()
        launched_ranks.spare_leaving_rank_zero()  # the strategy and CausalLM may both call it: wrapped once
        if leaving == "exiting":
            launched_ranks.mark_exiting()
        elif leaving == "failing":
            launched_ranks.mark_failing()
        assert observer._run() is True  # it saw the failed rank and stopped the others
        if leaving is None:  # still running: Lightning's kill, for a rank 0 stuck beside a dead rank
            assert rank_zero.wait(timeout=10) == -9
        else:  # left to finish with its own exit status
            with pytest.raises(subprocess.TimeoutExpired):
                rank_zero.wait(timeout=1)
    finally:
        rank_zero.kill()
        rank_zero.wait()


def test_rank_zero_that_ended_well_exits_with_a_failed_ranks_status(fresh_flags, monkeypatch):
    exits = []
    monkeypatch.setattr(launched_ranks.os, "_exit", exits.append)
    ranks = [SimpleNamespace(returncode=code) for code in (0, -9, 2)]  # one killed by the observer, one failed
    launched_ranks.exit_as_failed_ranks(ranks)
    launched_ranks.exit_as_failed_ranks(ranks[:2])  # ended by a signal only: 1
    launched_ranks.exit_as_failed_ranks(ranks[:1])  # every rank ended well: rank 0's own status stands
    assert exits == [2, 1]
    launched_ranks.mark_failing()
    launched_ranks.exit_as_failed_ranks(ranks)  # rank 0 failed itself: its own status stands
    assert exits == [2, 1]


def test_a_run_that_starts_after_a_failed_one_is_not_failing(fresh_flags):
    """A caught failure of an earlier fit must not make rank 0's exit cut short the ranks of a later one."""
    launched_ranks.mark_failing()
    launched_ranks.mark_running()  # the strategies' setup
    assert not launched_ranks.rank_zero_failed()


def test_a_failed_rank_zero_kills_the_ranks_still_running_and_says_so(capsys):
    """Rank 0 failed alone: a rank it launched waits in its next collective for it until the process group's
    timeout (rank 0 waited 120 s for it at exit, then left it to Lightning). It is killed, as torchrun's agent
    stops every worker when one fails: SIGKILL, since Lightning's SIGTERM handler runs only once the collective
    returns."""
    rank_one = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        launched_ranks.stop_ranks_left_running([rank_one], 10)
        assert rank_one.wait(timeout=5) == -9
    finally:
        rank_one.kill()
        rank_one.wait()
    said = capsys.readouterr().err
    assert "pl_lowprec: rank 0 failed, and rank 1 that it launched still ran 10 s later" in said
    assert "stopped rank 1 (SIGKILL)" in said
