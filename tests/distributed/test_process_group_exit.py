"""The default process group is destroyed at exit: Lightning does it for NCCL only, and a gloo group left alive
made finished 2-process runs abort at exit ("terminate called without an active exception", exit -6)."""

import atexit

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
