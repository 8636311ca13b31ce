"""A LightningModule of the user's own, written as a module file in a test's directory, with the YAML config that
``pl-lowprec fit`` reads: the model built in ``__init__`` from ``config_dir``, the weights from the strategy's
``pretrained=``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

OWN_CAUSAL_LM = """
import lightning as L
import torch
from transformers import AutoConfig, AutoModelForCausalLM


class MyLM(L.LightningModule):
    def __init__(self, config_dir: str):
        super().__init__()
        self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_dir))

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch, labels=batch).loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


class Bytes(L.LightningDataModule):
    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0)))
"""


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
