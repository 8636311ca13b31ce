"""Destroy the process group when the process exits, before the interpreter is torn down.

Lightning registers the destruction only for NCCL. With gloo, a run that trained and saved everything could end
with "terminate called without an active exception" (SIGABRT) on one of its ranks, nondeterministically: 2 of
13 two-rank FSDP2 fits on a CPU, and 1 of 10 under ``torchrun``. gdb shows gloo's worker thread
(``pt_gloo_runloop``) releasing the last collective it ran, a Lightning ``broadcast``, while the interpreter
finalizes: freeing the tensors' Python objects takes the GIL, which a finalizing interpreter refuses by ending
the thread, and a C++ thread cannot end there (the race of pytorch/pytorch#179291). The group is destroyed at
exit, while the interpreter is whole, then a full garbage collection frees the training objects that still hold
it (FSDP2's states, the device mesh), whose destructor joins those threads. A 2-rank gloo script that exits
right after ``broadcast_object_list`` aborted 9 times in 24 with ``destroy_process_group`` alone, 0 times in 24
with the collection after it, and 1 time in 24 where a live global also held the group (the collection cannot
free it; its own time let the thread finish in the other 23: there it is a mitigation, not a guarantee);
``python benchmarks/gloo_exit_race.py`` repeats it.

Rank 0 also waits for the ranks it launched (Lightning's launcher starts them as its child processes) before it
destroys its group: ``pl-lowprec fit`` returns when every rank is done, as under ``torchrun``, with rank 0's exit
status, or a failed rank's where rank 0 ended well (``launched_ranks.py``). Where rank 0's run failed, a rank that
failed with it ends within seconds, but one that did not waits in its next collective for rank 0 until the process
group's timeout: rank 0 waits ``FAILED_RANK_ZERO_WAIT_S`` for them, then kills those still running, as torchrun's
agent does on a worker's failure (it waited ``LAUNCHED_RANKS_WAIT_S`` and left them to exit on their own).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import subprocess
import time
from typing import Any

import torch.distributed as dist

from pl_lowprec.distributed.launched_ranks import (
    exit_as_failed_ranks,
    mark_exiting,
    rank_zero_failed,
    spare_leaving_rank_zero,
    stop_ranks_left_running,
)

# How long rank 0 waits at exit for the ranks it launched; a rank that is stuck is left to Lightning's launcher.
LAUNCHED_RANKS_WAIT_S = 120.0
# Where rank 0 failed: how long a rank that failed with it may take to end (its own exception's work and exit).
FAILED_RANK_ZERO_WAIT_S = 10.0

_registered = False
_launched: list[subprocess.Popen] = []


def destroy_process_group_at_exit(strategy: Any = None) -> None:
    """Register, once per process, the destruction of the default process group at interpreter exit, after the
    rank processes the ``strategy``'s launcher started (Lightning's ``_SubprocessScriptLauncher.procs``, on rank 0)
    have exited."""
    global _registered
    launched = getattr(getattr(strategy, "launcher", None), "procs", ())
    _launched.extend(proc for proc in launched if proc not in _launched)
    if launched:
        spare_leaving_rank_zero()
    if not _registered:
        atexit.register(_destroy_default_process_group)
        _registered = True


def _destroy_default_process_group() -> None:
    mark_exiting()
    failed = rank_zero_failed()
    wait_s = FAILED_RANK_ZERO_WAIT_S if failed else LAUNCHED_RANKS_WAIT_S
    deadline = time.monotonic() + wait_s
    for proc in _launched:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    if failed:
        stop_ranks_left_running(_launched, wait_s)
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        gc.collect()  # while the interpreter is whole: the group's last holders go, and its threads are joined
    exit_as_failed_ranks(_launched)
