"""A fine-tuned module rebuilt from the config it was trained with and one of its Lightning checkpoints.

The same path as resuming a fit: LightningCLI builds the Trainer, module and data from the config, Lightning's
``configure_model`` hook runs under the strategy's and precision's contexts, the strategy's ``ModelTransform``
loads the pretrained weights (quantizing as they stream in) and injects the adapters, and the checkpoint's
weights load into it. Nothing is trained; no process group is started, so a DDP config restores in one process,
and an FSDP config restores unsharded (the adapters are the same tensors either way).

Only what the rebuild needs is read from a config file: the model, the data module (its tokenizer), and of the
trainer its accelerator, devices, strategy and precision. Callbacks, loggers, the optimizer and the run's own
keys are dropped, so a callback that cannot be imported where the export runs does not matter; a class the
rebuild needs and cannot import is named, with its file, in one line (``ConfigClassError``).
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pl_lowprec.adapters import find_base_model
from pl_lowprec.loading import PretrainedWeights
from pl_lowprec.transforms.lora import has_lora
from pl_lowprec.transforms.pipeline import ModelTransform

KEPT_KEYS = ("seed_everything", "trainer", "model", "data")
KEPT_TRAINER_KEYS = ("accelerator", "devices", "num_nodes", "strategy", "precision", "plugins")
QUIET_TRAINER = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False}


class ConfigClassError(ValueError):
    """A class the rebuild needs cannot be imported; the message is one line naming it and its config file."""


@dataclass
class Restored:
    """The trained module on its device, in eval mode, and where its original weights came from."""

    module: nn.Module
    trainer: Any
    transform: ModelTransform
    weights: PretrainedWeights | None
    checkpoint: Path
    tokenizer_dir: str | None

    @property
    def hf_model(self) -> nn.Module | None:
        """The Hugging Face ``PreTrainedModel`` inside the module (what ``generate`` runs on), if there is one."""
        name, model = find_base_model(self.module)
        return model if name else None


def default_config(checkpoint: Path) -> Path | None:
    """LightningCLI saves ``config.yaml`` in the run's log directory, the parent of ``checkpoints/``."""
    candidate = checkpoint.parent.parent / "config.yaml"
    return candidate if candidate.is_file() else None


def rebuild_config(fields: dict[str, Any]) -> dict[str, Any]:
    """What of a training config the rebuild reads: the model, the data, and the trainer's device, strategy and
    precision settings; no callbacks, loggers, optimizer or run keys (``ckpt_path``)."""
    kept = {key: fields[key] for key in KEPT_KEYS if key in fields}
    trainer = fields.get("trainer")
    if isinstance(trainer, dict):
        kept["trainer"] = {key: trainer[key] for key in KEPT_TRAINER_KEYS if key in trainer} | QUIET_TRAINER
    return kept


def class_paths(value: Any, where: str) -> list[tuple[str, str]]:
    """Every ``class_path`` in a config section, with where it is (``trainer.strategy``, ``trainer.plugins``)."""
    if isinstance(value, list):
        return [found for item in value for found in class_paths(item, where)]
    if not isinstance(value, dict):
        return []
    found = [(where, value["class_path"])] if isinstance(value.get("class_path"), str) else []
    for key, inner in value.items():
        if key != "class_path":
            found += class_paths(inner, f"{where}.{key}" if key != "init_args" else where)
    return found


def check_importable(fields: dict[str, Any], source: str) -> None:
    """``ConfigClassError`` for the first dotted ``class_path`` that cannot be imported (short names are left to
    jsonargparse, which resolves them among the classes already imported)."""
    for where, class_path in class_paths(fields, ""):
        module, _, name = class_path.rpartition(".")
        if not module:
            continue
        try:
            found = hasattr(importlib.import_module(module), name)
        except ImportError as err:
            found, reason = False, f"{type(err).__name__}: {err}"
        else:
            reason = f"{module} has no {name}"
        if not found:
            raise ConfigClassError(
                f"{where.lstrip('.')} class_path {class_path!r} in {source} cannot be imported ({reason}); install"
                " it or add its directory to PYTHONPATH, or pass --config with a class that can be."
            )


def without_run_keys(cli_args: list[str]) -> list[str]:
    """``cli_args`` with each ``--config`` file given inline as ``rebuild_config`` of it, after checking that the
    classes it names can be imported."""
    import yaml

    out: list[str] = []
    args = iter(cli_args)
    for arg in args:
        name, _, value = arg.partition("=")
        if name != "--config":
            out.append(arg)
            continue
        value = value or next(args, "")
        path = Path(value)
        fields = yaml.safe_load(path.read_text()) if path.is_file() else yaml.safe_load(value)
        if isinstance(fields, dict):
            fields = rebuild_config(fields)
            check_importable(fields, str(path) if path.is_file() else "the --config given inline")
            value = yaml.safe_dump(fields)
        out += ["--config", value]
    return out


def restore(checkpoint: str | Path, cli_args: list[str]) -> Restored:
    """Rebuild the module of ``cli_args`` (``--config X.yaml`` and overrides) with the weights of ``checkpoint``."""
    from lightning.pytorch.trainer.call import _call_configure_model

    from pl_lowprec.cli import build_cli

    checkpoint = Path(checkpoint)
    if not checkpoint.is_file():
        raise FileNotFoundError(f"Checkpoint {str(checkpoint)!r} does not exist (a Lightning .ckpt file).")
    cli = build_cli(without_run_keys(cli_args), run=False)
    trainer, module = cli.trainer, cli.model
    transform = getattr(trainer.strategy, "transform", None)
    if not isinstance(transform, ModelTransform):
        raise ValueError(
            f"The config's strategy is {type(trainer.strategy).__name__}, not a pl_lowprec strategy: there is no"
            " lora= to export. Use the config the checkpoint was trained with."
        )
    if transform.sharding is not None:  # restore unsharded, in this one process (bitsandbytes storage)
        transform = dataclasses.replace(transform, sharding=None)
    state = trainer.strategy.load_checkpoint(checkpoint)
    if not isinstance(state, dict) or "state_dict" not in state:
        raise ValueError(f"{str(checkpoint)!r} is not a Lightning checkpoint: it has no 'state_dict'.")
    trainer.strategy.connect(module)
    module.trainer = trainer
    _call_configure_model(trainer)
    device = trainer.strategy.root_device
    transform.apply(module, trainer.precision_plugin, device)
    if not has_lora(module):
        raise ValueError(
            "The config trains no LoRA adapters (the strategy has no lora=), so there is nothing to export or"
            " merge. Pass the config the checkpoint was trained with."
        )
    _load(module, transform, state["state_dict"], checkpoint)
    module = trainer.precision_plugin.convert_module(module)
    module.to(device).eval()
    tokenizer = getattr(cli.datamodule, "tokenizer_dir", None) if cli.datamodule is not None else None
    return Restored(module, trainer, transform, transform.weights_for(module), checkpoint, tokenizer)


def _load(module: nn.Module, transform: ModelTransform, state_dict: dict[str, torch.Tensor], path: Path) -> None:
    """Adapter-only or full, whichever the checkpoint holds; a mismatch names the checkpoint and the config."""
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    if not any("lora_" in key for key in state_dict):
        raise ValueError(
            f"{str(path)!r} holds no LoRA weights ({len(state_dict)} tensors, e.g. {sorted(state_dict)[:3]}): it was"
            " not written by a run with lora=, so there are no adapters to export."
        )
    adapter_only = set(state_dict) <= trainable
    try:
        dataclasses.replace(transform, adapter_only_checkpoint=adapter_only).load_state_dict(
            module, state_dict, strict=True
        )
    except RuntimeError as err:
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        shown = " ".join(lines[:3]) + (f" ... ({len(lines) - 3} more lines)" if len(lines) > 3 else "")
        raise ValueError(
            f"{str(path)!r} does not fit the module built from the config: {shown} Pass the config it was trained"
            " with (lora= rank and target_modules, quantization=, the model and its pretrained weights)."
        ) from err
