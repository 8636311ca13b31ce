"""``pl-lowprec estimate --config X.yaml``: the memory estimate of a training config, before running it.

Reads the same YAML that ``pl-lowprec fit`` runs. The model is built on the meta device (nothing allocated);
the data module is built for real, only to take the shape of one training batch.
"""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path
from typing import Any

import torch
import yaml

from pl_lowprec.memory.estimate import MemoryEstimate, estimate_memory


def _import(class_path: str) -> Any:
    if "." not in class_path:  # a short name, as jsonargparse resolves them for the package's classes
        import pl_lowprec
        import pl_lowprec.demo

        for namespace in (pl_lowprec, pl_lowprec.demo):
            if hasattr(namespace, class_path):
                return getattr(namespace, class_path)
        raise ValueError(f"class_path {class_path!r} is not a pl_lowprec class; give the full import path.")
    module, _, name = class_path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _build(spec: dict[str, Any]) -> Any:
    return _import(spec["class_path"])(**(spec.get("init_args") or {}))


def _precision(trainer: dict[str, Any]) -> str:
    """The config's precision; ``AMPPrecision`` without one is ``"auto"``, its default."""
    for plugin in trainer.get("plugins") or []:
        if not isinstance(plugin, dict):
            continue
        if "precision" in (plugin.get("init_args") or {}):
            return str(plugin["init_args"]["precision"])
        if str(plugin.get("class_path", "")).rpartition(".")[2] == "AMPPrecision":
            return "auto"
    return str(trainer.get("precision") or "32-true")


def _device(trainer: dict[str, Any]) -> str:
    """The device type a config's ``trainer.accelerator`` runs on, as Lightning would pick it here."""
    accelerator = str(trainer.get("accelerator") or "auto")
    if accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available()):
        return "cuda"
    return "cpu"


def _strategy_settings(trainer: dict[str, Any]) -> dict[str, Any]:
    strategy = trainer.get("strategy")
    if not isinstance(strategy, dict):
        return {}
    args = dict(strategy.get("init_args") or {})
    for key in ("qat", "fp8"):
        if isinstance(args.get(key), dict):
            args[key] = _build(args[key])
    quantization = args.get("quantization")
    if isinstance(quantization, dict):
        args["quantization"] = _build(quantization)
    keys = (
        "quantization",
        "lora",
        "optimizer",
        "activation_checkpointing",
        "checkpoint_every_n",
        "checkpoint_impl",
        "activation_offloading",
        "qat",
        "fp8",
    )
    settings = {k: args[k] for k in keys if k in args}
    settings.setdefault("optimizer", "adamw")
    return settings


def estimate_config(path: str | Path) -> MemoryEstimate:
    """The estimate for a ``pl-lowprec fit`` YAML file."""
    config = yaml.safe_load(Path(path).read_text())
    trainer = config.get("trainer") or {}
    model_spec = config["model"]
    datamodule = _build(config["data"])
    datamodule.setup("fit")
    batch = next(iter(datamodule.train_dataloader()))
    return estimate_memory(
        lambda: _build(model_spec),
        batch,
        precision=_precision(trainer),
        device=_device(trainer),
        **_strategy_settings(trainer),
    )


def main(args: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="pl-lowprec estimate", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="a YAML file that `pl-lowprec fit --config` runs")
    options = parser.parse_args(args)
    print(estimate_config(options.config).table())
