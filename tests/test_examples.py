"""The examples run as scripts with --fast."""

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("script", ["plain_amp_loop.py", "plain_transformer_classifier.py"])
def test_example_runs_fast(script, tmp_path):
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--fast"], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    if script == "plain_transformer_classifier.py":
        assert "Loss scale: " in result.stdout and "Memory, fit" in result.stdout
    else:
        assert "epoch 0: mean loss" in result.stdout
