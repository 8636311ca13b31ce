"""A run rebuilt from its config exactly as ``pl-lowprec fit`` builds it, without running: ``export``,
``generate`` and ``estimate`` read configs through this one module.

The parser is ``LowPrecisionCLI``'s (the same classes, defaults, checks and one-paragraph refusals as ``fit``).
Only what a rebuild needs is read from a config file: the model, the data module, and of the trainer its
accelerator, devices, strategy and precision; ``estimate`` and ``plan`` (``rebuild_classes``) also read the
optimizer and LR scheduler (``--optimizer``), which the simulated step builds as ``fit`` does. Callbacks, loggers
and the run's own keys (``ckpt_path``) are dropped, and so are the optimizer keys for ``export`` and
``generate``, so a callback or optimizer that cannot be imported where the export runs does not matter; a class
the rebuild needs and cannot import is named, with its file, in one line (``ConfigClassError``).
"""

from __future__ import annotations

import argparse
import importlib
import warnings
from pathlib import Path
from typing import Any

import torch

from pl_lowprec.cli.arguments import config_values, inline_from, options, read_config
from pl_lowprec.cli.lightning_cli import LowPrecisionCLI, build_cli
from pl_lowprec.cli.run_paths import run_relative_overrides
from pl_lowprec.loading.sources import shapes_only

KEPT_KEYS = ("seed_everything", "trainer", "model", "data")
OPTIMIZER_KEYS = ("optimizer", "lr_scheduler")  # LightningCLI's --optimizer and --lr_scheduler: what fit steps with
KEPT_TRAINER_KEYS = (
    "accelerator",
    "devices",
    "num_nodes",
    "strategy",
    "precision",
    "plugins",
    "accumulate_grad_batches",
)
QUIET_TRAINER = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False}


class ConfigClassError(ValueError):
    """A class the rebuild needs cannot be imported; the message is one line naming it and its config file."""


def default_config(checkpoint: Path) -> Path | None:
    """LightningCLI saves ``config.yaml`` in the run's log directory, the parent of ``checkpoints/``."""
    candidate = checkpoint.parent.parent / "config.yaml"
    return candidate if candidate.is_file() else None


def rebuild_config(fields: dict[str, Any], kept_keys: tuple[str, ...] = KEPT_KEYS) -> dict[str, Any]:
    """What of a training config the rebuild reads: the model, the data, and the trainer's device, strategy and
    precision settings (and the other ``kept_keys``); no callbacks, loggers or run keys (``ckpt_path``)."""
    kept = {key: fields[key] for key in kept_keys if key in fields}
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


def without_run_keys(cli_args: list[str], kept_keys: tuple[str, ...] = KEPT_KEYS) -> list[str]:
    """``cli_args`` with each ``--config`` file given inline as ``rebuild_config`` of it, after checking that the
    classes it names can be imported."""
    out: list[str] = []
    for option in options(cli_args):
        if option.name != "--config":
            out += option.given
            continue
        fields, source = read_config(option.value)
        if isinstance(fields, dict):
            fields = rebuild_config(fields, kept_keys)
            check_importable(fields, source)
            out += ["--config", inline_from(fields, source)]
        else:
            out += ["--config", option.value]
    return out


def with_config(checkpoint: Path, cli_args: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``cli_args``, with the run's saved ``config.yaml`` in front when no ``--config`` is given (its relative paths
    taken from where the run started, ``run_relative_overrides``; the command line's own overrides still win)."""
    if config_values(cli_args):
        return cli_args
    found = default_config(checkpoint)
    if found is None:
        parser.error(f"no --config given and no config.yaml in {checkpoint.parent.parent}: pass --config X.yaml.")
    moved, said = run_relative_overrides(found)
    if said:
        print(said)
    return ["--config", str(found), *moved, *cli_args]


def passed_on(
    parser: argparse.ArgumentParser, args: list[str] | None, keep: tuple[str, ...] = ("--config",)
) -> list[str]:
    """``args`` without the subcommand's own options (``parser``'s, except ``keep``), in the order given: the
    ``--config`` files and overrides, for LightningCLI to read as ``pl-lowprec fit`` reads them (a later
    ``--config`` or override wins over an earlier one). ``parser`` must not accept abbreviations."""
    own = {name: action for action in parser._actions for name in action.option_strings if name not in keep}
    out: list[str] = []
    remaining = iter(args or [])
    for arg in remaining:
        name, equals, _ = arg.partition("=")
        action = own.get(name)
        if action is None:
            out.append(arg)
        elif not equals and action.nargs != 0:
            next(remaining, None)  # its value
    return out


def config_files(cli_args: list[str]) -> dict[str, Path | None]:
    """The ``--config`` files among ``cli_args``, as ``{what: path}`` for the inputs ``--out`` must spare."""
    paths = [Path(value) for value in config_values(cli_args)]
    return {"config" if len(paths) == 1 else f"config ({i + 1} of {len(paths)})": path for i, path in enumerate(paths)}


def rebuild(cli_args: list[str]) -> LowPrecisionCLI:
    """The Trainer, module and data module of ``cli_args`` (``--config X.yaml`` and overrides), built as ``fit``
    builds them; nothing runs (``configure_model`` included)."""
    return _build(cli_args, LowPrecisionCLI)


class _WithoutTrainer(LowPrecisionCLI):
    """The config's classes (model on the meta device, data, strategy, plugins) and no Trainer: a config for a
    GPU is estimated on a machine without one, and a model larger than this machine allocates nothing."""

    def instantiate_classes(self) -> None:
        with torch.device("meta"), shapes_only():  # a strategy's pretrained= may be a directory of config.json
            super().instantiate_classes()

    def instantiate_trainer(self, **kwargs: Any) -> None:
        return None


def rebuild_classes(cli_args: list[str]) -> LowPrecisionCLI:
    """As ``rebuild``, but no Trainer is built and the model is on the meta device; the trainer's arguments,
    strategy and plugins built, are in ``config_init.trainer``. The config's ``optimizer`` and ``lr_scheduler``
    are kept: they replace the module's ``configure_optimizers`` as in ``fit`` (``deferred_optimizer.py``)."""
    return _build(cli_args, _WithoutTrainer, KEPT_KEYS + OPTIMIZER_KEYS)


def _build(
    cli_args: list[str], cli_class: type[LowPrecisionCLI], kept_keys: tuple[str, ...] = KEPT_KEYS
) -> LowPrecisionCLI:
    with warnings.catch_warnings():  # the subcommand's own arguments are meant to differ from sys.argv
        warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
        return build_cli(without_run_keys(cli_args, kept_keys), run=False, cli_class=cli_class)
