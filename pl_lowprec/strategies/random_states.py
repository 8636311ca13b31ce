"""Every rank's random generators in the checkpoint, set again as a resumed run starts training.

Lightning saves none, so a resumed run draws other dropout masks (LoRA's ``lora_dropout``, a model's own dropout)
than the uninterrupted run from its first step on, and ends with other adapters. Hugging Face's ``Trainer``
saves each process's states for this (``rng_state_{rank}.pth``); here they travel in the one checkpoint file:
every rank's states (torch, CUDA, NumPy, Python) gathered as the file is written, each rank taking its own back.
They are set in ``on_train_start``, not as the checkpoint loads: in between, the strategy builds the model
(LoRA's initialization draws), which the uninterrupted run did before its first step. Stored as tensors and
plain numbers, so the file still loads with ``torch.load(weights_only=True)``.

A resumption where an epoch ended has one more draw to replay: the uninterrupted run starts the next epoch's loader
iterator after the checkpoint was written, and a ``DataLoader`` without its own ``generator`` draws its workers'
base seed (and a ``RandomSampler`` its shuffle) from the global generator then. Lightning starts the resumed run's
iterator before ``on_train_start``, from other states; ``restart_epoch_iterator`` starts it again from the restored
ones, so the data order and the dropout masks are the uninterrupted run's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch.distributed as dist
from torch.utils.data import DataLoader

from pl_lowprec.distributed.several_ranks import several_ranks
from pl_lowprec.generator_states import random_states
from pl_lowprec.strategies.unresumable_data import resumed_where_an_epoch_ended

CHECKPOINT_KEY = "pl_lowprec_random_states"  # a list: one entry per rank


def restart_epoch_iterator(trainer: Any) -> bool:
    """After ``set_random_states`` at an epoch's boundary: start the training loaders' iterator again where every
    loader is a plain ``DataLoader`` drawing from the global generator (``generator=None``); whether it did. A loader
    with its own state (``resumable_loader``) or generator draws nothing from the global one and is left alone."""
    combined, fetcher = trainer.fit_loop._combined_loader, trainer.fit_loop._data_fetcher
    if combined is None or fetcher is None or not resumed_where_an_epoch_ended(trainer):
        return False  # inside an epoch: the uninterrupted run drew at the epoch's start, before the checkpoint
    loaders = combined.flattened
    if not all(type(loader) is DataLoader and loader.generator is None for loader in loaders):
        return False
    iter(fetcher)
    return True


def every_ranks_random_states(mine: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """``random_states()`` of each rank, in rank order, this rank's overridden by ``mine`` where given (a resumed
    run's states not set yet); every rank calls it (an all-gather where there are several)."""
    mine = random_states() if mine is None else {**random_states(), **mine}
    if not several_ranks():
        return [mine]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return gathered


def own_random_states(checkpoint: Mapping[str, Any], rank: int, world_size: int) -> dict[str, Any] | None:
    """This rank's states in ``checkpoint``; ``None`` where it holds none, or another number of ranks'."""
    saved = checkpoint.get(CHECKPOINT_KEY)
    if not saved or len(saved) != world_size:
        return None
    return saved[rank]
