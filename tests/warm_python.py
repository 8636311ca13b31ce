"""Run a test script as ``python SCRIPT ARGS`` would, in a child forked from an interpreter that has already
imported torch, Lightning, transformers and peft.

Why: a fresh interpreter spends about 5 s of CPU importing them before the script's first line, most of what a
short training script costs on a 2-core machine, and the suite starts dozens. ``multiprocessing``'s forkserver
imports them once, in a single-threaded server (no OpenMP pool, no test-runner threads), and forks each script
from it. What the script sees is what ``python SCRIPT ARGS`` gives it: ``sys.argv``, the environment, the
working directory, ``sys.path`` (the script's folder, then ``PYTHONPATH``), its own stdout and stderr, its exit
status (``-9`` when it kills itself) and the ``atexit`` handlers at the end. ``ranks=2`` starts each rank of a
multi-process script as a warm child, as torchrun does (``LOCAL_RANK``, ``NODE_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT`` set, so Lightning creates no processes); the user's own command, ``pl-lowprec fit
--trainer.devices 2``, keeps Lightning's launcher and is tested from a shell.

Not for tests whose subject is a fresh interpreter (imports, the CLI from a shell, resident memory).
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.connection
import os
import runpy
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from lightning.fabric.plugins.environments.lightning import find_free_network_port

_PRELOAD = ["torch", "lightning.pytorch", "transformers", "peft", "pl_lowprec"]
_CONTEXT = multiprocessing.get_context("forkserver")
# On a GPU machine importing peft initialises CUDA (run 6 on an H200: torch.cuda.is_initialized() turned True at
# its import, with bitsandbytes installed), and a child forked after that cannot use CUDA: there each child
# imports what it needs itself.
_CONTEXT.set_forkserver_preload([] if torch.cuda.is_available() else _PRELOAD)


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1


def _as_python_would(script: str, args: list[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    """The child: set up what ``python SCRIPT ARGS`` would, run the script as ``__main__``, then exit as it would."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    for fd, path in ((1, out), (2, err)):
        file = os.open(path, os.O_WRONLY)
        os.dup2(file, fd)
        os.close(file)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:0] = [str(Path(script).parent), *extra]
    sys.argv = [script, *args]
    try:
        runpy.run_path(script, run_name="__main__")
        status = 0
    except SystemExit as stop:
        status = _exit_status(stop.code)
    except BaseException:
        traceback.print_exc()
        status = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


class WarmProcess:
    """``subprocess.Popen(command, stdout=PIPE, stderr=PIPE, text=True)`` for ``command = [python, SCRIPT, *ARGS]``."""

    def __init__(self, command: list[str], env: dict[str, str] | None = None, cwd: str | Path | None = None):
        if len(command) < 2 or command[0] != sys.executable or command[1].startswith("-"):
            raise ValueError(f"a warm child runs `python SCRIPT ARGS`, not {command[:3]}")
        self.args = command
        self._folder = tempfile.TemporaryDirectory(prefix="warm_python_")
        self._out, self._err = (os.path.join(self._folder.name, name) for name in ("stdout", "stderr"))
        for path in (self._out, self._err):
            Path(path).touch()
        environment = dict(os.environ if env is None else env)
        target = (str(command[1]), [str(a) for a in command[2:]], environment, str(cwd or os.getcwd()))
        self._process = _CONTEXT.Process(target=_as_python_would, args=(*target, self._out, self._err))
        self._process.start()
        self.returncode: int | None = None

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self._process.join(timeout)
        if self._process.exitcode is None:
            self._process.kill()
            self._process.join()
            raise subprocess.TimeoutExpired(self.args, timeout)
        self.returncode = self._process.exitcode
        try:
            return Path(self._out).read_text(), Path(self._err).read_text()
        finally:
            self._folder.cleanup()


class WarmRanks:
    """``ranks`` warm children of one multi-process script, started as torchrun starts them. Its exit status is
    that of the first rank to fail (0 if none did); the others then get ``grace`` seconds to end and are killed
    (nothing else would stop a rank waiting in a collective for a dead one). stdout and stderr: rank 0's, then
    rank 1's."""

    def __init__(
        self,
        command: list[str],
        ranks: int,
        env: dict[str, str] | None = None,
        cwd: str | Path | None = None,
        grace: float = 30.0,
    ):
        group = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(find_free_network_port())}
        shared = {**(os.environ if env is None else env), **group}
        self.args, self.grace, self.returncode = command, grace, None
        self._ranks = [
            WarmProcess(command, env={**shared, "LOCAL_RANK": str(r), "NODE_RANK": "0"}, cwd=cwd) for r in range(ranks)
        ]

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        processes = [rank._process for rank in self._ranks]
        deadline = None if timeout is None else time.monotonic() + timeout
        failed_at, first_failure = None, 0
        while any(p.exitcode is None for p in processes):
            failed = [p.exitcode for p in processes if p.exitcode not in (None, 0)]
            if failed_at is None and failed:
                failed_at, first_failure = time.monotonic(), failed[0]
            now = time.monotonic()
            if (failed_at is not None and now > failed_at + self.grace) or (deadline is not None and now > deadline):
                for p in processes:
                    p.kill()
                if deadline is not None and now > deadline:
                    raise subprocess.TimeoutExpired(self.args, timeout)
            multiprocessing.connection.wait([p.sentinel for p in processes if p.exitcode is None], timeout=0.2)
        outputs = [rank.communicate() for rank in self._ranks]
        failed = [rank.returncode for rank in self._ranks if rank.returncode != 0]
        self.returncode = first_failure or (failed[0] if failed else 0)
        return "".join(out for out, _ in outputs), "".join(err for _, err in outputs)


def with_pythonpath(folder: str | Path, env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (this process's environment by default) with ``folder`` first on ``PYTHONPATH``: a script beside
    the tests imports their helpers from there."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join([str(folder), env.get("PYTHONPATH", "")])
    return env


def run(
    command: list[str],
    timeout: float | None = None,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    capture_output: bool = True,
    text: bool = True,
    ranks: int = 1,
    pythonpath: str | Path | None = None,
) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True, ...)`` in a warm child, or in ``ranks`` of them
    (it always captures text); ``pythonpath`` goes first on the environment's ``PYTHONPATH``."""
    if not (capture_output and text):
        raise ValueError("a warm child's output is always captured as text")
    if pythonpath is not None:
        env = with_pythonpath(pythonpath, env)
    process = WarmProcess(command, env=env, cwd=cwd) if ranks == 1 else WarmRanks(command, ranks, env=env, cwd=cwd)
    stdout, stderr = process.communicate(timeout)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def spawn(function: Callable[..., None], args: tuple = (), nprocs: int = 2) -> None:
    """``torch.multiprocessing.spawn(function, args, nprocs)`` in warm children: forked from the forkserver that
    imported torch once, where ``spawn`` started a fresh interpreter per process (its 5 s of imports each)."""
    torch.multiprocessing.start_processes(function, args=args, nprocs=nprocs, start_method="forkserver")
