"""What ``--ckpt_path`` must satisfy before anything loads: it exists, it is a checkpoint, and it is this run's.

Lightning treats ``ckpt_path="last"`` that finds nothing as a fresh start (one warning), and LightningCLI replaces
the config's model arguments with those saved in the checkpoint. Either way a user who meant to resume trains
something else without being told. Here both are errors that say what was searched or what differs, unless the
user says so: ``--allow_fresh_start true`` (nothing found: start from scratch) and ``--allow_changed_hparams true``
(the config's values win over the checkpoint's).
"""

from __future__ import annotations

import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from pl_lowprec._hparams import path_globals

RUN_ONLY = {"num_workers"}  # arguments that may change between a run and its resumption


def check_checkpoint(path: Path, argument: str = "--ckpt_path") -> None:
    """A clear error for a missing path or a file that is no ``torch.save`` archive."""
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        near = path if path.is_dir() else path.parent
        found = newest([*near.glob("*.ckpt"), *near.glob("checkpoints/*.ckpt")]) if near.is_dir() else []  # not **
        there = f" The newest there: {', '.join(map(str, found))}." if found else ""
        raise FileNotFoundError(f"{argument} {str(path)!r} {what}: name a Lightning checkpoint file (.ckpt).{there}")
    if not zipfile.is_zipfile(path):
        raise ValueError(
            f"{argument} {str(path)!r} is not a Lightning checkpoint (not a torch.save archive; {path.stat().st_size}"
            " bytes). Name the .ckpt a run wrote under its checkpoints/ directory."
        )


def last_checkpoints(trainer: Any) -> tuple[list[str], list[str]]:
    """What ``ckpt_path="last"`` resolves among (as Lightning finds it), and the directories searched."""
    found: set[str] = set()
    searched: list[str] = []
    for callback in trainer.checkpoint_callbacks:
        if isinstance(callback, ModelCheckpoint):
            searched.append(str(callback._ModelCheckpoint__resolve_ckpt_dir(trainer)))
            found |= {p for p in callback._find_last_checkpoints(trainer) if Path(p).is_file()}
    return sorted(found), searched


def newest_checkpoints(root: str | Path, name: str = "*.ckpt", limit: int = 3) -> list[Path]:
    """The newest files called ``name`` under ``root`` (``last*.ckpt``: the runs a user may have meant)."""
    return newest(Path(root).glob(f"**/{name}"), limit)


def newest(paths: Iterable[Path], limit: int = 3) -> list[Path]:
    """The ``limit`` most recently written of ``paths``."""
    return sorted(paths, key=lambda p: p.stat().st_mtime, reverse=True)[:limit]


def checkpoints_there(trainer: Any, use: str) -> str:
    """What ``--ckpt_path last`` could have meant: other runs' ``last*.ckpt``, else the newest checkpoints of any
    name; and, where no ``ModelCheckpoint`` sets ``save_last``, that this config never writes a ``last.ckpt``."""
    root = trainer.default_root_dir
    others = newest_checkpoints(root, "last*.ckpt")
    listed = ", ".join(map(str, others or newest_checkpoints(root)))
    what = "Other runs' last checkpoints" if others else f"The newest checkpoints under {root!s}"
    hint = f" {what}: {listed}; pass one as --ckpt_path to {use} it." if listed else ""
    savers = [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)]
    if savers and not any(cb.save_last for cb in savers):
        hint += (
            " No checkpoint callback of this config sets save_last (Lightning's default does not), so its runs write"
            " no last.ckpt: for --ckpt_path last to find them, add one that does (trainer.callbacks: class_path"
            " pl_lowprec.callbacks.StepBoundaryCheckpoint, init_args {save_last: true}, as the shipped"
            " finetune-causal-lm.yaml has)."
        )
    return hint


def earlier_runs_last(trainer: Any) -> tuple[list[str], str | None]:
    """The ``last*.ckpt`` of the earlier runs under an auto-numbered logger (CSV, TensorBoard), ``version_*`` beside
    this run's own, and the pattern searched.

    Each ``fit`` logs to a new ``version_N``, as Lightning numbers them, so a resumed run never writes into the
    earlier run's directory (Lightning would delete its ``metrics.csv``, and ``config.yaml`` would be replaced);
    ``last`` still finds the run to resume among the earlier versions."""
    logger = trainer.logger
    if logger is None or getattr(logger, "_version", "set") is not None or not hasattr(logger, "root_dir"):
        return [], None  # no logger, or a version the user chose (or already in use): Lightning's own search only
    pattern = "version_*/checkpoints/last*.ckpt"
    found = [str(p) for p in Path(logger.root_dir).glob(pattern) if p.is_file()]
    return found, str(Path(logger.root_dir) / "version_*" / "checkpoints")


def resolve_ckpt_path(
    trainer: Any, ckpt_path: str | None, allow_fresh_start: bool, subcommand: str = "fit"
) -> str | None:
    """``ckpt_path`` as Lightning will use it; ``None`` for a fresh start the user allowed, else an error that
    says what ``subcommand`` would do without it: ``fit`` trains from scratch, the others use the untrained model
    the config builds."""
    if ckpt_path is None or ckpt_path in ("best", "hpc") or "://" in str(ckpt_path):
        return ckpt_path
    if subcommand == "fit":
        without, use = "train from scratch", "resume"
        fresh = "pass --allow_fresh_start true to start from scratch when there is nothing to resume"
        fix = (
            f"To resume, name the .ckpt; to begin a new run, leave out --ckpt_path or {fresh} (a job that resumes"
            " itself)."
        )
        missing = f"so there is nothing to resume. Name an existing .ckpt, or {fresh}."
    else:
        without, use = f"{subcommand} the model the config builds, untrained", "use"
        fix = f"Name the .ckpt to use, or leave out --ckpt_path to {without}."
        missing = (
            f"so {subcommand} has no trained weights to use. Name an existing .ckpt, or leave out --ckpt_path to"
            f" {without}."
        )
    if ckpt_path == "last":
        earlier, pattern = earlier_runs_last(trainer)  # before Lightning's search picks this run's version
        found, searched = last_checkpoints(trainer)
        found, searched = sorted({*found, *earlier}), [*searched, *([pattern] if pattern else [])]
        if found:
            return max(found, key=lambda p: Path(p).stat().st_mtime)
        if allow_fresh_start:
            return None
        where = f"in {', '.join(map(repr, searched))}" if searched else "(no ModelCheckpoint callback saves one)"
        raise FileNotFoundError(
            f"--ckpt_path last found no last checkpoint {where}; Lightning would {without}."
            f"{checkpoints_there(trainer, use)} {fix}"
        )
    path = Path(ckpt_path)
    if not path.exists() and allow_fresh_start:
        return None
    if not path.exists():
        raise FileNotFoundError(f"--ckpt_path {str(path)!r} does not exist, {missing}")
    check_checkpoint(path)
    return ckpt_path


def _plain(value: Any) -> Any:
    """A value as YAML would hold it, so that a config's and a checkpoint's copies compare equal."""
    if isinstance(value, dict) or hasattr(value, "as_dict"):
        items = value.as_dict() if hasattr(value, "as_dict") else value
        return {k: _plain(v) for k, v in items.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, str) and isinstance(b, str) and a != b and Path(a).exists() and Path(b).exists():
        return Path(a).resolve() == Path(b).resolve()  # runs/demo/model and /abs/runs/demo/model
    return a == b


def hparam_differences(saved: dict[str, Any], configured: Any, key: str) -> list[str]:
    """``key.arg: checkpoint X, config Y`` for each saved argument the config sets differently."""
    if not saved or configured is None:
        return []
    configured = _plain(configured)
    saved = {k: _plain(v) for k, v in saved.items() if k != "_instantiator"}
    differences = []
    saved_class = saved.pop("_class_path", None)
    if saved_class and configured.get("class_path") and saved_class != configured["class_path"]:
        differences.append(f"{key}: checkpoint {saved_class}, config {configured['class_path']}")
    arguments = configured.get("init_args", {}) if "class_path" in configured else configured
    for name, value in saved.items():
        if name in arguments and name not in RUN_ONLY and not _same(value, arguments[name]):
            differences.append(f"{key}.{name}: checkpoint {value!r}, config {arguments[name]!r}")
    return differences


def check_same_run(checkpoint: Path, config: Any, allow_changed_hparams: bool, resuming: bool = True) -> list[str]:
    """The model and data arguments saved in ``checkpoint`` against ``config``'s; an error when they differ.
    ``resuming=False`` (validate, test, predict): only the model's, since scoring other data is the point."""
    with path_globals():
        saved = torch.load(checkpoint, weights_only=True, map_location="cpu", mmap=True)
    differences = hparam_differences(saved.get("hyper_parameters", {}), config.get("model"), "model")
    if resuming:
        differences += hparam_differences(saved.get("datamodule_hyper_parameters", {}), config.get("data"), "data")
    if differences and not allow_changed_hparams:
        raise ValueError(
            f"--ckpt_path {str(checkpoint)!r} was trained with other arguments than this config sets: "
            + "; ".join(differences)
            + ". Resume with the run's own config (its config.yaml beside checkpoints/), or, if the change is meant"
            " (a new stage of training), pass --allow_changed_hparams true: the module gets the config's values, and"
            " the optimizer state (learning rate included) still comes from the checkpoint."
        )
    return differences


def finished_run_line(checkpoint: Path, max_steps: int) -> str | None:
    """Where ``checkpoint`` is at ``max_steps`` already, a line saying that ``fit`` has nothing to train (Lightning
    restores it and stops at once, which reads like a failed resume); ``None`` otherwise. Not a refusal: a job that
    resumes itself (``--ckpt_path last``) may start again after it finished."""
    if max_steps is None or max_steps < 0:
        return None
    with path_globals():
        step = torch.load(checkpoint, weights_only=True, map_location="cpu", mmap=True).get("global_step")
    if not isinstance(step, int) or step < max_steps:
        return None
    return (
        f"--ckpt_path {str(checkpoint)!r} is at step {step}, and trainer.max_steps is {max_steps}: this run is"
        f" finished, so fit stops at once. To train on, raise it (--trainer.max_steps {max_steps * 2})."
    )
