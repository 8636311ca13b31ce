"""Run a test script as ``python SCRIPT ARGS`` would, in a child forked from an interpreter that has already
imported torch, Lightning, transformers and peft.

Why: a fresh interpreter spends about 5 s of CPU importing them before the script's first line, most of what a
short training script costs on a 2-core machine, and the suite starts dozens. ``multiprocessing``'s forkserver
imports them once, in a single-threaded server (no OpenMP pool, no test-runner threads), and forks each script
from it. What the script sees is what ``python SCRIPT ARGS`` gives it: ``sys.argv``, the environment, the
working directory, ``sys.path`` (the script's folder, then ``PYTHONPATH``), its own stdout and stderr, its exit
status (``-9`` when it kills itself) and the ``atexit`` handlers at the end. Lightning still starts the other
ranks of a multi-rank script as fresh interpreters, from ``sys.argv``.

Not for tests whose subject is a fresh interpreter (imports, the CLI from a shell, resident memory).
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

_PRELOAD = ["torch", "lightning.pytorch", "transformers", "peft", "pl_lowprec"]
_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(_PRELOAD)


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


def run(
    command: list[str],
    timeout: float | None = None,
    env: dict[str, str] | None = None,
    cwd: str | Path | None = None,
    capture_output: bool = True,
    text: bool = True,
) -> subprocess.CompletedProcess:
    """``subprocess.run(command, capture_output=True, text=True, ...)`` in a warm child (it always captures text)."""
    if not (capture_output and text):
        raise ValueError("a warm child's output is always captured as text")
    process = WarmProcess(command, env=env, cwd=cwd)
    stdout, stderr = process.communicate(timeout)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
