"""tests/warm_python.py runs a script as `python SCRIPT ARGS` does: the same output, exit status and atexit."""

import os
import subprocess
import sys

import pytest
import warm_python

SCRIPT = """
import atexit, os, signal, sys
atexit.register(lambda: print("atexit ran"))
print(sys.argv[1:], os.environ.get("WARM_PYTHON_TEST"), os.getcwd(), sys.path[0], sys.path[1], __name__)
print("to stderr", file=sys.stderr)
if sys.argv[1] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if sys.argv[1] == "raise":
    raise ValueError("raised by the script")
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("mode", ["0", "3", "kill", "raise"])
def test_a_warm_child_behaves_as_a_fresh_interpreter(tmp_path, mode):
    script = tmp_path / "folder" / "script.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    env = {**os.environ, "WARM_PYTHON_TEST": "set", "PYTHONPATH": str(tmp_path)}
    command = [sys.executable, str(script), mode]
    fresh = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60)
    warm = warm_python.run(command, env=env, cwd=tmp_path, timeout=60)
    assert (warm.returncode, warm.stdout) == (fresh.returncode, fresh.stdout)
    assert warm.returncode == {"0": 0, "3": 3, "kill": -9, "raise": 1}[mode]
    assert ("atexit ran" in warm.stdout) is (mode != "kill")
    assert warm.stderr.startswith("to stderr\n")
    assert warm.stderr.rstrip().endswith("ValueError: raised by the script") is (mode == "raise")


RANKS_SCRIPT = """
import os, sys, time
rank = int(os.environ["LOCAL_RANK"])
print(f"rank {rank} of a group at {os.environ['MASTER_ADDR']}:{int(os.environ['MASTER_PORT']) > 0}")
sys.stdout.flush()
if sys.argv[1] == "fail" and rank == 1:
    sys.exit(5)
if sys.argv[1] == "fail":
    time.sleep(600)  # as a rank waiting in a collective for a dead one
"""


@pytest.mark.parametrize("mode", ["ok", "fail"])
def test_ranks_start_as_torchrun_starts_them_and_a_failed_rank_ends_the_others(tmp_path, mode):
    script = tmp_path / "ranks.py"
    script.write_text(RANKS_SCRIPT)
    ranks = warm_python.WarmRanks([sys.executable, str(script), mode], 2, grace=1.0)
    stdout, _ = ranks.communicate(timeout=120)
    assert stdout == "rank 0 of a group at 127.0.0.1:True\nrank 1 of a group at 127.0.0.1:True\n"
    assert ranks.returncode == {"ok": 0, "fail": 5}[mode]  # rank 1's, not rank 0's -9 after the grace
