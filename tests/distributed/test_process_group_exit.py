"""The default process group is destroyed at exit: Lightning does it for NCCL only, and a gloo group left alive
made finished 2-process runs abort at exit ("terminate called without an active exception", exit -6)."""

import atexit
from types import SimpleNamespace

import torch.distributed as dist

from pl_lowprec.distributed import process_group_exit
from pl_lowprec.distributed.process_group_exit import destroy_process_group_at_exit


def test_registered_once_and_destroys_the_default_group(tmp_path, monkeypatch):
    registered = []
    monkeypatch.setattr(process_group_exit, "_registered", False)
    monkeypatch.setattr(atexit, "register", registered.append)
    destroy_process_group_at_exit()
    destroy_process_group_at_exit()
    assert len(registered) == 1

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    assert dist.is_initialized()
    registered[0]()
    assert not dist.is_initialized()
    registered[0]()  # nothing left to destroy: a no-op, not an error


def test_rank_zero_waits_for_the_ranks_it_launched_before_destroying_its_group(tmp_path, monkeypatch):
    """Under Lightning's launcher rank 0 returns when every rank is done, as under torchrun."""
    registered, events = [], []

    class LaunchedRank:
        returncode = 0

        def wait(self, timeout):
            events.append(("waited", timeout, dist.is_initialized()))
            return 0

    monkeypatch.setattr(process_group_exit, "_registered", False)
    monkeypatch.setattr(process_group_exit, "_launched", [])
    monkeypatch.setattr(atexit, "register", registered.append)
    monkeypatch.setattr(process_group_exit.gc, "collect", lambda: events.append(("collected", dist.is_initialized())))
    strategy = SimpleNamespace(launcher=SimpleNamespace(procs=[LaunchedRank()]))  # rank 0's, under Lightning's launcher
    destroy_process_group_at_exit(strategy)
    destroy_process_group_at_exit(strategy)  # the strategy and CausalLM may both register: waited for once
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    registered[0]()
    # the launched rank waited for while the group was alive; then the group destroyed and its holders collected,
    # which lets gloo's worker threads finish before the interpreter is torn down
    assert events == [("waited", process_group_exit.LAUNCHED_RANKS_WAIT_S, True), ("collected", False)]
    assert not dist.is_initialized()
