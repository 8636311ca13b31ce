"""The relative paths of a run's saved ``config.yaml``, read from another directory than the run started in.

LightningCLI saves the config as it was given: ``pretrained: runs/demo/model`` means that path from where ``fit``
ran. ``export`` and ``generate`` read that file by themselves (``--ckpt_path`` alone), from wherever the user
is; a relative path that exists from the run's directory and not from here is taken from the run's directory,
and said. Where the run started follows from its log directory and ``trainer.default_root_dir``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

SECTIONS = ("model", "data")  # and trainer.strategy: where a run names its files


def run_started_in(run_dir: Path, default_root_dir: str | None) -> Path | None:
    """The directory ``fit`` ran in: the ancestor of ``run_dir`` (the log directory, ``config.yaml``'s) below
    which ``default_root_dir`` lies; ``None`` where it is absolute, unknown or not among the ancestors."""
    if not default_root_dir or Path(default_root_dir).is_absolute():
        return None
    root = [part for part in Path(default_root_dir).parts if part != "."]
    for ancestor in [run_dir, *run_dir.parents]:
        if root and list(ancestor.parts[-len(root) :]) == root:
            return Path(*ancestor.parts[: -len(root)])
    return None


def _leaves(node: Any, key: str) -> list[tuple[str, Any]]:
    """``(dotted key, value)`` of every value that is not a mapping, keys as LightningCLI takes them."""
    if not isinstance(node, dict):
        return [(key, node)]
    return [found for name, value in node.items() for found in _leaves(value, f"{key}.{name}")]


def _moved(value: str, started: Path) -> str | None:
    """``value`` from ``started`` when it is a relative path there and nothing here."""
    if not value or "\n" in value or value.startswith("~") or Path(value).is_absolute() or Path(value).exists():
        return None
    there = started / value
    return str(there) if there.exists() else None


def run_relative_overrides(config_file: Path) -> tuple[list[str], str | None]:
    """Overrides (``--key=value``) taking the saved config's relative paths from where the run started, and a
    line saying so (``None`` when there are none: run from the same directory, or nothing moved)."""
    fields = yaml.safe_load(config_file.read_text())
    if not isinstance(fields, dict):
        return [], None
    trainer = fields.get("trainer") if isinstance(fields.get("trainer"), dict) else {}
    started = run_started_in(config_file.resolve().parent, trainer.get("default_root_dir"))
    if started is None or started == Path.cwd().resolve():
        return [], None
    sections = {name: fields.get(name) for name in SECTIONS} | {"trainer.strategy": trainer.get("strategy")}
    overrides, said = [], []
    for section, node in sections.items():
        for key, value in _leaves(node, section):
            values = value if isinstance(value, list) else [value]
            if not values or not all(isinstance(v, str) for v in values):
                continue
            moved = [_moved(v, started) for v in values]
            if not any(moved):
                continue
            new = [m or v for m, v in zip(moved, values, strict=True)]
            overrides.append(f"--{key}={json.dumps(new) if isinstance(value, list) else new[0]}")
            said += [v for m, v in zip(moved, values, strict=True) if m]
    if not overrides:
        return [], None
    return overrides, (
        f"The run's {config_file} names paths relative to the directory the run started in, {started}, and this"
        f" command runs in {Path.cwd()}: taking {', '.join(said)} from {started}."
    )
