"""``pl-lowprec estimate`` simulates the optimizer fit steps with: LightningCLI's ``optimizer`` section, from the
config or the command line, as fit builds it (the config's section used to be dropped without a word)."""

from __future__ import annotations

from pathlib import Path

import yaml

from pl_lowprec.cli.estimate import estimate_config

ACCUMULATION = str(Path(__file__).resolve().parents[2] / "configs/accumulation.yaml")  # TinyGPT, AdamW of its own


def _with_optimizer(tmp_path: Path, optimizer: dict) -> str:
    fields = yaml.safe_load(Path(ACCUMULATION).read_text())
    path = tmp_path / "with_optimizer.yaml"
    path.write_text(yaml.safe_dump({**fields, "optimizer": optimizer}))
    return str(path)


def test_the_configs_optimizer_section_is_the_simulated_optimizer(tmp_path):
    own = estimate_config(["--config", ACCUMULATION])
    sgd = estimate_config(["--config", _with_optimizer(tmp_path, {"class_path": "torch.optim.SGD"})])
    assert own.optimizer.startswith("optimizer: AdamW (") and own.optimizer_state > 2 * own.gradients
    assert sgd.optimizer.startswith("optimizer: SGD (") and sgd.optimizer_state == 0
    assert sgd.peak < own.peak
    assert sgd.optimizer in sgd.table()


def test_the_command_lines_optimizer_is_the_simulated_optimizer():
    amsgrad = estimate_config(["--config", ACCUMULATION, "--optimizer=torch.optim.Adam", "--optimizer.amsgrad=true"])
    assert amsgrad.optimizer.startswith("optimizer: Adam (")
    assert amsgrad.optimizer_state > 3 * amsgrad.gradients  # three moments and a step each
