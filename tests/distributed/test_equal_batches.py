"""Ranks whose own loaders give different numbers of batches are refused before the first step, on every rank."""

import sys
from pathlib import Path

import pytest
import warm_python

SCRIPT = Path(__file__).parents[1] / "_scripts" / "uneven_batches_ddp.py"


def _run(tmp_path: Path, max_steps: int) -> list[str]:
    result = warm_python.run([sys.executable, str(SCRIPT), str(tmp_path), str(max_steps)], timeout=300, ranks=2)
    assert result.returncode == 0, result.stderr[-4000:]
    assert "all_gather is deprecated" not in result.stderr  # Lightning's strategy.all_gather warns on torch 2.13
    return [(tmp_path / f"rank{rank}.txt").read_text() for rank in range(2)]


@pytest.mark.slow
def test_loaders_of_different_lengths_are_refused_on_every_rank(tmp_path):
    # Before: rank 1 (6 batches) finished "successfully" after 6 steps while rank 0 (7) stopped in gloo's
    # "Connection closed by peer" traceback (NCCL: a hang until the process-group timeout).
    said = _run(tmp_path, -1)
    for text in said:
        assert text.startswith("error: The ranks' training loaders give different numbers of batches per epoch")
        assert "(rank 0: 7, rank 1: 6)" in text and "limit_train_batches=6" in text
    assert said[0] == said[1]


@pytest.mark.slow
def test_max_steps_inside_the_shortest_epoch_trains_on(tmp_path):
    assert _run(tmp_path, 3) == ["steps: 3", "steps: 3"]
