"""The default process group is destroyed at exit: Lightning does it for NCCL only, and a gloo group left alive
made finished 2-process runs abort at exit ("terminate called without an active exception", exit -6)."""

import atexit
import subprocess
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from pl_lowprec.distributed import launched_ranks, process_group_exit
from pl_lowprec.distributed.process_group_exit import destroy_process_group_at_exit


@pytest.fixture
def registered(monkeypatch) -> list:
    """The exit handlers registered (``atexit``'s, in a list: the test calls them, the test process's exit does not),
    none yet and no launched rank."""
    handlers: list = []
    monkeypatch.setattr(process_group_exit, "_registered", False)
    monkeypatch.setattr(process_group_exit, "_launched", [])
    monkeypatch.setattr(atexit, "register", handlers.append)
    return handlers


def test_registered_once_and_destroys_the_default_group(tmp_path, registered):
    destroy_process_group_at_exit()
    destroy_process_group_at_exit()
    assert len(registered) == 1

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    assert dist.is_initialized()
    registered[0]()
    assert not dist.is_initialized()
    registered[0]()  # nothing left to destroy: a no-op, not an error


def test_rank_zero_waits_for_the_ranks_it_launched_before_destroying_its_group(
    tmp_path, monkeypatch, registered, fresh_flags
):
    """Under Lightning's launcher rank 0 returns when every rank is done, as under torchrun."""
    events = []

    class LaunchedRank:
        returncode = 0

        def wait(self, timeout):
            events.append(("waited", timeout, dist.is_initialized()))
            return 0

    monkeypatch.setattr(process_group_exit.gc, "collect", lambda: events.append(("collected", dist.is_initialized())))
    strategy = SimpleNamespace(launcher=SimpleNamespace(procs=[LaunchedRank()]))  # rank 0's, under Lightning's launcher
    destroy_process_group_at_exit(strategy)
    destroy_process_group_at_exit(strategy)  # the strategy and CausalLM may both register: waited for once
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    registered[0]()
    # the launched rank waited for while the group was alive; then the group destroyed and its holders collected,
    # which lets gloo's worker threads finish before the interpreter is torn down
    waited = pytest.approx(process_group_exit.LAUNCHED_RANKS_WAIT_S, abs=1.0)
    assert events == [("waited", waited, True), ("collected", False)]
    assert not dist.is_initialized()


def test_a_failed_rank_zero_waits_briefly_then_stops_the_ranks_still_running(capsys, registered, fresh_flags):
    """Rank 0 failed alone: rank 1 waits in a collective for it until the process group's timeout. Rank 0 waited
    120 s for it, then left it to Lightning; it now waits FAILED_RANK_ZERO_WAIT_S and kills it, as torchrun does."""
    events = []

    class StuckRank:
        returncode = None

        def wait(self, timeout=None):
            if self.returncode is None:
                events.append(("waited", round(timeout)))
                raise subprocess.TimeoutExpired("rank 1", timeout)
            return self.returncode

        def poll(self):
            return self.returncode

        def kill(self):
            events.append("killed")
            self.returncode = -9

    launched_ranks.mark_failing()
    destroy_process_group_at_exit(SimpleNamespace(launcher=SimpleNamespace(procs=[StuckRank()])))
    registered[0]()
    assert events == [("waited", process_group_exit.FAILED_RANK_ZERO_WAIT_S), "killed"]
    said = capsys.readouterr().err
    assert "rank 0 failed, and rank 1 that it launched still ran 10 s later" in said
    assert "stopped rank 1 (SIGKILL)" in said
