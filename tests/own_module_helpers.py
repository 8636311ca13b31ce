"""A LightningModule of the user's own, written as a module file in a test's directory, with the YAML config that
``pl-lowprec fit`` reads: the model built in ``__init__`` from ``config_dir``, the weights from the strategy's
``pretrained=``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def write_own_module(directory: Path, name: str, source: str, monkeypatch: Any) -> None:
    """``directory/name.py`` importable, and ``directory`` the working directory (the run's ``runs/`` go there)."""
    (directory / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(directory))
    monkeypatch.chdir(directory)


def write_own_config(
    path: Path, model: str, data: str, pretrained: Path, strategy: dict[str, Any], max_steps: int = 2
) -> Path:
    """A fit config: ``model`` (``module.Class``) built from ``pretrained``'s config, filled from its weights."""
    config = {
        "trainer": {
            "max_steps": max_steps,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "strategy": {
                "class_path": "pl_lowprec.LowPrecisionStrategy",
                "init_args": {**strategy, "pretrained": str(pretrained)},
            },
        },
        "model": {"class_path": model, "init_args": {"config_dir": str(pretrained)}},
        "data": {"class_path": data},
    }
    path.write_text(yaml.safe_dump(config))
    return path
