"""estimate --plot: the step as stacked categories; without matplotlib, refused before any work, naming the extra."""

import functools
from pathlib import Path

import pytest
import torch

import pl_lowprec._imports as imports
from pl_lowprec import estimate_memory
from pl_lowprec.cli import estimate as cli_estimate
from pl_lowprec.cli.estimate import main
from pl_lowprec.demo import TinyLlama
from pl_lowprec.memory.plot import phase_starts, plot_step

ROOT = Path(__file__).resolve().parents[2]


class _Missing:
    message = "No module named 'matplotlib'"

    def __bool__(self):
        return False


@pytest.fixture
def no_matplotlib(monkeypatch):
    monkeypatch.setattr(imports, "_MATPLOTLIB", _Missing())
    imports.import_matplotlib_pyplot.cache_clear()
    yield
    imports.import_matplotlib_pyplot.cache_clear()


def test_plot_without_matplotlib_is_refused_before_the_estimate_with_the_install_command(
    no_matplotlib, tmp_path, monkeypatch
):
    out = tmp_path / "step.png"
    monkeypatch.setattr(cli_estimate, "estimate_config", lambda args: pytest.fail("the estimate ran first"))
    with pytest.raises(ModuleNotFoundError, match=r'--plot needs matplotlib: .*pip install "pl_lowprec\[plot\]"'):
        main(["--config", str(ROOT / "configs/quickstart.yaml"), "--plot", str(out)])
    assert not out.exists()


def test_the_plot_is_drawn_from_the_simulated_step(tmp_path):
    pytest.importorskip("matplotlib")
    build = functools.partial(TinyLlama, hidden_size=64, intermediate_size=128, num_layers=2, max_len=64)
    estimate = estimate_memory(build, {"input_ids": torch.zeros(2, 64, dtype=torch.long)}, lora={"r": 4})
    path = plot_step(estimate, tmp_path / "step.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    starts = phase_starts(estimate.samples)  # every phase labelled where it begins, the first one too
    assert starts[0] == (0, "forward") and [name for _, name in starts][1:3] == ["backward", "optimizer step"]
