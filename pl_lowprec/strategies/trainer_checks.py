"""Trainer arguments that Lightning 2.6 accepts but divides by later, checked before any step.

``Trainer(accumulate_grad_batches=0)`` is accepted and fails inside step 1 with ``ZeroDivisionError``;
``check_val_every_n_epoch=0`` and ``val_check_interval=0`` fail the same way at the first validation check.
``check_trainer_arguments`` runs when the CLI builds the Trainer and again in the strategies' ``setup``.

An integer ``val_check_interval`` above the training batches of an epoch is refused by Lightning only once its
fit loop starts, after the model has loaded (minutes for a large checkpoint);
``check_validation_interval`` counts the batches as Lightning will, before the strategies load the model.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from lightning.fabric.utilities.data import sized_len
from lightning.pytorch.trainer.connectors.data_connector import _parse_num_batches
from lightning.pytorch.trainer.states import RunningStage, TrainerFn
from torch.utils.data import DataLoader


def first_callback(trainer: Any, types: tuple[type, ...]) -> Any:
    """The first of ``trainer``'s callbacks that is one of ``types``, or ``None``."""
    return next((callback for callback in trainer.callbacks if isinstance(callback, types)), None)


def check_trainer_arguments(trainer: Any) -> None:
    """``ValueError`` naming the first Trainer argument that would fail or mislead once training runs."""
    check_accumulation(trainer.accumulate_grad_batches)
    every_n_epochs = trainer.check_val_every_n_epoch
    if every_n_epochs is not None and every_n_epochs < 1:
        raise ValueError(
            f"Trainer(check_val_every_n_epoch={every_n_epochs!r}) must be an integer >= 1, or None to validate"
            " every val_check_interval batches regardless of epochs."
        )
    interval = trainer.val_check_interval
    if isinstance(interval, (int, float)) and not isinstance(interval, bool) and interval <= 0:
        raise ValueError(
            f"Trainer(val_check_interval={interval!r}) must be > 0: an integer number of batches, or a float in"
            " (0, 1] for a fraction of the epoch. To skip validation pass limit_val_batches=0."
        )
    clip = trainer.gradient_clip_val
    if clip is not None and (not math.isfinite(clip) or clip < 0):
        raise ValueError(f"Trainer(gradient_clip_val={clip!r}) must be a finite number >= 0 (0 or None: no clipping).")
    if trainer.log_every_n_steps < 0:
        raise ValueError(f"Trainer(log_every_n_steps={trainer.log_every_n_steps!r}) must be >= 0 (0: never log).")
    sanity = trainer.num_sanity_val_steps
    if sanity < 0 and sanity != -1 and not math.isinf(sanity):
        raise ValueError(
            f"Trainer(num_sanity_val_steps={sanity!r}) must be >= 0, or -1 to check every validation batch."
        )


def check_accumulation(accumulate: Any) -> None:
    """``ValueError`` unless ``accumulate_grad_batches`` is an integer >= 1 (``fit``'s refusal, also ``estimate``'s)."""
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise ValueError(
            f"Trainer(accumulate_grad_batches={accumulate!r}) must be an integer >= 1 (1: an optimizer step every"
            " batch; 4: one step every 4 batches, the effective batch 4x larger)."
        )


def check_num_nodes(num_nodes: Any) -> None:
    """``ValueError`` unless ``num_nodes`` is an integer >= 1, in the words of Lightning's own refusal."""
    if isinstance(num_nodes, bool) or not isinstance(num_nodes, int) or num_nodes < 1:
        raise ValueError(f"`num_nodes` must be a positive integer, but got {num_nodes}.")


def check_validation_interval(trainer: Any, loader: Callable[[], Any]) -> None:
    """``ValueError`` where ``Trainer(val_check_interval=<int>)`` is more than the training batches of an epoch
    on this process, on the terms of Lightning's own check (``_FitLoop.setup_data``); only when fitting.
    ``loader`` gives the run's training loader (``memory.budget.training_loader``), asked for only if needed."""
    interval = trainer.val_check_interval
    if (
        trainer.state.fn != TrainerFn.FITTING
        or not isinstance(interval, int)
        or isinstance(interval, bool)
        or trainer.check_val_every_n_epoch is None
        or not trainer.limit_val_batches
        or getattr(trainer, "_val_check_time_interval", None) is not None
    ):
        return
    batches = training_batches(trainer, loader)
    if batches is None or interval <= batches:
        return
    processes = f" on each of {trainer.world_size} processes" if trainer.world_size > 1 else ""
    raise ValueError(
        f"Trainer(val_check_interval={interval}) is more than the {batches} training batches of an epoch here"
        f"{processes}, so Lightning would stop at the first epoch, after loading the model. Allowed: an integer up"
        f" to {batches}, a float in (0, 1] for a fraction of the epoch, or check_val_every_n_epoch=None to count"
        " the batches across epochs (with max_steps set); limit_val_batches=0 skips validation."
    )


def training_batches(trainer: Any, loader: Callable[[], Any]) -> int | None:
    """The training batches one epoch of ``loader()`` has on this process, as Lightning's fit loop will count
    them (its distributed sampler and ``limit_train_batches`` included); ``None`` where the loader is not one
    sized ``DataLoader`` (Lightning checks those itself)."""
    try:
        training = loader()
    except Exception:  # no training data attached: Lightning says so itself
        return None
    if not isinstance(training, DataLoader):
        return None
    training = trainer._data_connector._prepare_dataloader(training, shuffle=True, mode=RunningStage.TRAINING)
    length = sized_len(training)
    if length is None:
        return None
    return _parse_num_batches(RunningStage.TRAINING, length, trainer.limit_train_batches)


def batches_started(trainer: Any) -> int:
    """How many batches any loop (fit, sanity check, validate, test, predict) has started."""
    if trainer is None:
        return 0
    loops = [
        trainer.fit_loop.epoch_loop,
        trainer.fit_loop.epoch_loop.val_loop,
        trainer.validate_loop,
        trainer.test_loop,
        trainer.predict_loop,
    ]
    return sum(loop.batch_progress.total.ready for loop in loops)
