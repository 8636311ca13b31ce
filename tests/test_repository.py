"""Generated outputs stay out of git: runs, tests and benchmarks write files that must never be committed."""

import fnmatch
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GENERATED = ["*memory_summary.json", "*.ckpt", "*.safetensors", "*results/*.json", "runs/*", "*lightning_logs/*"]


def test_no_generated_output_is_tracked():
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    tracked = listed.stdout.splitlines()
    offenders = [path for path in tracked if any(fnmatch.fnmatch(path, pattern) for pattern in GENERATED)]
    assert not offenders, f"generated outputs are tracked: {offenders}; git rm --cached them and ignore them"
