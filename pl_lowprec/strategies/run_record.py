"""The trainer and data settings a checkpoint was saved with, compared with the run that resumes from it.

Lightning saves the loops' counters, the optimizer and scheduler states and the module's and data module's
``save_hyperparameters``, but none of the Trainer's arguments, and checks only ``max_epochs`` against the saved
epoch. A run resumed with another ``accumulate_grad_batches``, batch size, ``seq_len``, precision or number of
processes restores everything and trains on, but not as the saved run would have: "exact resume" silently is not.
So the strategies record these settings in every checkpoint (``CHECKPOINT_KEY``) and, before the first resumed
step, say in one warning what changed (old and new values), what it means, and how to resume exactly. A changed
``max_steps`` is said only where it moves the learning rate: a schedule rebuilt from it (``LambdaLR`` over
``estimated_stepping_batches``, as ``CausalLM``'s) no longer gives the saved run's rate at the saved step; raising
``max_steps`` with a schedule that goes on is the documented way to train on. Another scheduler keeps its saved
arguments (``T_max``, ``total_steps``) over the ones this run built from the new length: said too, with both values
(``scheduler_arguments.py``).

Warned, not refused: each change is also a deliberate way to go on training (more devices, a batch that fits
another GPU, bf16 where the hardware has it, a longer run), and the run works; it only is not the saved one
continued. Refused elsewhere are the resumptions that fail or train another model than the config asks: another
optimizer library (``optimizer_record.py``) and other model arguments (``cli/resume.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.optim.lr_scheduler import LambdaLR

from pl_lowprec.strategies.scheduler_arguments import kept_arguments

CHECKPOINT_KEY = "pl_lowprec_run"

# what a change means for the resumed run, by setting
MEANING = {
    "accumulate_grad_batches": "each optimizer step sums another number of micro-batches (another global batch),"
    " so every step from here sees other rows",
    "world_size": "another number of processes: another global batch, each process another shard of the data, and"
    " the saved per-process random states are not restored (dropout masks and shuffles start anew)",
    "batch_size": "each micro-batch holds another number of rows (another global batch), and a loader position"
    " saved in batches points elsewhere in the epoch",
    "seq_len": "the data is cut into other blocks: other rows and tokens in every batch",
    "precision": "the steps compute in another precision (and a loss scale is dropped or starts anew), so the"
    " losses and weights part from the saved run's at once",
}
TRAINER_ARGUMENT = {  # how each is set, for the fix
    "accumulate_grad_batches": "trainer.accumulate_grad_batches",
    "world_size": "trainer.devices x trainer.num_nodes",
    "batch_size": "the training loader's batch_size",
    "seq_len": "data.seq_len",
    "precision": "trainer.precision",
}


def run_record(trainer: Any) -> dict[str, Any]:
    """The settings of ``trainer``'s run that a resumption must keep to continue it exactly."""
    return {
        "accumulate_grad_batches": int(trainer.accumulate_grad_batches),
        "world_size": int(trainer.world_size),
        "batch_size": _batch_size(trainer),
        "seq_len": _seq_len(trainer),
        "precision": str(trainer.strategy.precision_plugin.precision),
        "max_steps": int(trainer.max_steps),
    }


def _batch_size(trainer: Any) -> int | None:
    loader = getattr(trainer.fit_loop, "_combined_loader", None)
    loaders = loader.flattened if loader is not None else []
    sizes = [getattr(one, "batch_size", None) for one in loaders]
    return sizes[0] if len(sizes) == 1 and isinstance(sizes[0], int) else None


def _seq_len(trainer: Any) -> int | None:
    value = getattr(getattr(trainer, "datamodule", None), "seq_len", None)
    return value if isinstance(value, int) else None


def saved_run(checkpoint: Mapping[str, Any], precision_plugin: Any) -> dict[str, Any] | None:
    """The checkpoint's record, less its precision where this run's plugin says a change of it itself
    (``AMPPrecision`` resuming its own state: with the loss scaler's fate and the plugin argument that keeps it)."""
    record = checkpoint.get(CHECKPOINT_KEY)
    if not isinstance(record, Mapping):
        return None
    plugin_state = checkpoint.get(type(precision_plugin).__qualname__)
    says_itself = isinstance(plugin_state, Mapping) and "precision" in plugin_state
    return {k: v for k, v in record.items() if not (says_itself and k == "precision")}


def changed_settings(saved: Mapping[str, Any], now: Mapping[str, Any]) -> list[str]:
    """``name old -> new: what it means`` for each recorded setting that differs (unknown on either side: not
    compared)."""
    said = []
    for name, meaning in MEANING.items():
        old, new = saved.get(name), now.get(name)
        if old is not None and new is not None and old != new:
            said.append(f"{name} {old} -> {new}: {meaning}")
    return said


def schedule_jumps(trainer: Any) -> list[str]:
    """For each restored ``LambdaLR`` whose rebuilt function gives another rate at the saved step than the saved
    run's: ``old -> new`` (its function comes from ``configure_optimizers``, not from the checkpoint)."""
    said = []
    for config in getattr(trainer, "lr_scheduler_configs", []):
        scheduler = config.scheduler
        if not isinstance(scheduler, LambdaLR):
            continue
        saved = scheduler.get_last_lr()
        pairs = zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)
        rebuilt = [base * rate(scheduler.last_epoch) for base, rate in pairs]
        if any(not math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12) for a, b in zip(saved, rebuilt, strict=True)):
            said.append(f"{_rates(saved)} -> {_rates(rebuilt)}")
    return said


def _rates(rates: list[float]) -> str:
    return ", ".join(f"{rate:.4g}" for rate in rates)


def changed_run_paragraph(
    trainer: Any, saved: Mapping[str, Any] | None, built_schedulers: list[dict[str, Any]] | None = None
) -> str | None:
    """The warning for a resumption whose settings differ from the checkpoint's (``saved``: its record;
    ``built_schedulers``: the schedulers' arguments as this run built them, ``scheduler_arguments.py``), or ``None``
    where it continues the saved run (or the checkpoint holds no record)."""
    if not saved:
        return None
    now = run_record(trainer)
    changes = changed_settings(saved, now)
    jumps = schedule_jumps(trainer)
    kept = kept_arguments(getattr(trainer, "lr_scheduler_configs", []), built_schedulers)
    steps_changed = saved.get("max_steps") != now["max_steps"]
    steps = f"max_steps {saved.get('max_steps')} -> {now['max_steps']}, " if steps_changed else ""
    if jumps:
        changes.append(
            f"{steps}the learning rate at step {trainer.global_step}: {'; '.join(jumps)} (the schedule"
            " configure_optimizers builds from this run's length, estimated_stepping_batches, is not the saved one's)"
        )
    if kept:
        changes.append(
            f"{'' if jumps else steps}the restored scheduler keeps the checkpoint's arguments, not those"
            f" configure_optimizers built for this run: {', '.join(kept)}; the saved schedule goes on and ends where"
            " the saved run's ended (past that a cosine's rate climbs back up and OneCycleLR stops the run with an"
            " error)"
        )
    if not changes:
        return None
    keep = [
        f"{TRAINER_ARGUMENT[name]}={saved[name]}"
        for name in MEANING
        if saved.get(name) is not None and now.get(name) is not None and saved[name] != now[name]
    ]
    fix = f"To resume exactly, run with the saved values ({', '.join(keep)})" if keep else ""
    if (jumps or kept) and steps_changed:
        fix += "; " if fix else ""
        fix += (
            f"a schedule built from max_steps keeps the saved run's rates only at its saved max_steps"
            f" ({saved.get('max_steps')}): to train longer on one schedule, start anew with the longer max_steps"
        )
    elif kept:
        fix += "; " if fix else ""
        fix += "to follow this run's scheduler arguments, start anew (a resumed scheduler is the saved one)"
    return (
        f"This run resumes from {trainer.ckpt_path} at step {trainer.global_step} with other settings than that"
        f" checkpoint was saved with, so it does not continue the saved run exactly: {'; '.join(changes)}."
        f"{f' {fix[0].upper()}{fix[1:]}.' if fix else ''} If the change is meant, it trains on as set."
    )


def warn_changed_run(
    trainer: Any, saved: Mapping[str, Any] | None, built_schedulers: list[dict[str, Any]] | None = None
) -> None:
    paragraph = changed_run_paragraph(trainer, saved, built_schedulers)
    if paragraph:
        rank_zero_warn(paragraph)
