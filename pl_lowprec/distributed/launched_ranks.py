"""Rank 0 under Lightning's launcher (the process that started the other ranks) ends with the run's own status.

Lightning's ``_ChildProcessObserver`` SIGKILLs rank 0 as soon as a rank it launched exits non-zero: meant for a
rank 0 stuck in a collective beside a dead rank. But where every rank refuses the same bad setting (one paragraph,
exit status 2), rank 0 is on its way out too, and the kill turned the command's status 2 into 137 ("Killed", which
reads as the out-of-memory killer) in 2 of 6 two-rank ``pl-lowprec fit --trainer.strategy=lowprec_fsdp`` runs.
Once rank 0 is failing (its strategy's ``on_exception``) or exiting (``atexit``), the observer still stops the
other ranks but leaves rank 0 to finish with its own status; a rank 0 that ends well while a rank it launched
failed exits with that rank's status, as the kill made it fail before.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Sequence

from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver

_leaving = threading.Event()  # rank 0 is failing or exiting: the observer must not kill it
_failing = threading.Event()  # rank 0 failed itself: its own exit status stands


def spare_leaving_rank_zero() -> None:
    """Make each running ``_ChildProcessObserver`` of this process stop only the launched ranks once rank 0 is
    leaving; until then it kills rank 0 too, as Lightning does. Called where the launcher has started them."""
    for thread in threading.enumerate():
        if isinstance(thread, _ChildProcessObserver) and not getattr(thread, "_spares_rank_zero", False):
            thread._terminate_all = _sparing(thread)
            thread._spares_rank_zero = True


def _sparing(observer: _ChildProcessObserver):
    terminate_all = observer._terminate_all

    def terminate() -> None:
        if not _leaving.is_set():
            terminate_all()
            return
        for proc in observer._child_processes:
            proc.send_signal(observer._termination_signal)

    return terminate


def mark_failing() -> None:
    """This rank's run raised (the strategies' ``on_exception``): on rank 0, it exits with its own status, which
    the observer must not replace by a kill."""
    _failing.set()
    _leaving.set()


def mark_running() -> None:
    """A run starts (the strategies' ``setup``): an earlier run of this process that failed, its exception caught,
    is not this one."""
    _failing.clear()
    _leaving.clear()


def mark_exiting() -> None:
    """This process is exiting (its ``atexit`` handlers run)."""
    _leaving.set()


def rank_zero_failed() -> bool:
    """Whether this process's run raised (``mark_failing``)."""
    return _failing.is_set()


def stop_ranks_left_running(launched: Sequence[subprocess.Popen], waited_s: float) -> None:
    """Where rank 0 failed: kill each rank it launched that still runs ``waited_s`` seconds later (a rank whose
    next collective waits for rank 0 would wait until the process group's timeout), as torchrun's agent stops
    every worker when one fails, and say so. SIGKILL, as Lightning's own observer: Lightning's SIGTERM handler
    would run only once the collective returns."""
    running = [rank for rank, proc in enumerate(launched, start=1) if proc.poll() is None]
    if not running:
        return
    for rank in running:
        launched[rank - 1].kill()
    for rank in running:
        launched[rank - 1].wait()
    names = f"rank{'s' if len(running) > 1 else ''} {', '.join(map(str, running))}"
    print(
        f"pl_lowprec: rank 0 failed, and {names} that it launched still ran {waited_s:g} s later (waiting for rank 0"
        f" in a collective, which would last until the process group's timeout): stopped {names} (SIGKILL), as"
        " torchrun stops every rank when one fails. Rank 0's error above is the run's.",
        file=sys.stderr,
        flush=True,
    )


def exit_as_failed_ranks(launched: list[subprocess.Popen]) -> None:
    """At rank 0's exit, after waiting for ``launched``: where one of them failed and rank 0 did not, exit with
    that rank's status (the first positive one; 1 for a rank ended by a signal)."""
    codes = [proc.returncode for proc in launched if proc.returncode]
    if not codes or rank_zero_failed():
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(next((code for code in codes if code > 0), 1))
