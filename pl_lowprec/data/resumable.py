"""Training batches that resume mid-epoch exactly where a killed run stopped.

Lightning saves and restores the state of any training ``DataLoader`` with ``state_dict``/``load_state_dict``
(``_FitLoop.on_save_checkpoint``); without one, a resumed epoch starts again from its first batch. Here the
order of an epoch is a function of ``(seed, epoch)`` (``DistributedSampler``'s shuffling, one shard per
rank), so the state is just the epoch and how many batches of it the training loop has consumed. The count
comes from the Trainer's own progress, not from the loader's iterator, which runs ahead of training by the
fetcher's prefetched batch and the workers' queues. On resume the sampler skips that many batches' indices:
skipped samples are never loaded.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler


class ResumableSampler(DistributedSampler):
    """``DistributedSampler`` (seed + epoch shuffling, one shard per rank) that can start an epoch part-way.

    Being a ``DistributedSampler``, Lightning leaves it in place under DDP instead of wrapping it.
    """

    def __init__(
        self,
        dataset: Dataset,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        epoch_indexed: bool = False,
    ):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self.resume_at: tuple[int, int] | None = None  # (epoch, samples of this rank's shard to skip)
        self.epoch_indexed = epoch_indexed  # yield epoch * len(dataset) + index (``PackedRows`` repacks per epoch)

    def __iter__(self) -> Iterator[int]:
        indices = list(super().__iter__())
        if self.resume_at is not None and self.resume_at[0] == self.epoch:
            indices = indices[self.resume_at[1] :]
        self.resume_at = None
        if self.epoch_indexed:
            indices = [self.epoch * len(self.dataset) + i for i in indices]
        return iter(indices)


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` over a ``ResumableSampler`` whose state is (epoch, batches consumed by training).

    Each iterator draws its workers' base seed from the loader's own generator, seeded by (seed, epoch), not from
    torch's global one: a ``DataLoader`` without a generator takes a draw from the global generator at every
    epoch, and a resumed run, which opens its epoch at another moment, would draw other dropout masks after it."""

    consumed: Callable[[], int] | None = None

    def __iter__(self) -> Any:
        if self.generator is not None:
            self.generator.manual_seed(self.sampler.seed + self.sampler.epoch)
        return super().__iter__()

    def state_dict(self) -> dict[str, Any]:
        sampler = self.sampler
        return {
            "epoch": sampler.epoch,
            "batches": self.consumed() if self.consumed is not None else 0,
            "batch_size": self.batch_size,
            "seed": sampler.seed,
            "num_samples": len(sampler.dataset),
            "num_replicas": sampler.num_replicas,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        sampler = self.sampler
        now = {
            "batch_size": self.batch_size,
            "seed": sampler.seed,
            "num_samples": len(sampler.dataset),
            "num_replicas": sampler.num_replicas,
        }
        changed = {k: (state.get(k), v) for k, v in now.items() if state.get(k) != v}
        if changed:
            shown = ", ".join(f"{k}: {old} in the checkpoint, {new} now" for k, (old, new) in changed.items())
            raise ValueError(
                f"Cannot resume the training data where the checkpoint stopped: {shown}. The same batches need the"
                " same data, seed, batch size and number of processes; change them only when starting afresh."
            )
        sampler.resume_at = (state["epoch"], state["batches"] * self.batch_size)


def consumed_train_batches(trainer: pl.Trainer) -> int:
    """Training batches of the current epoch the loop has processed (not merely fetched)."""
    return trainer.fit_loop.epoch_loop.batch_progress.current.processed


def data_parallel_shard(trainer: pl.Trainer | None) -> tuple[int, int]:
    """(replicas, this process's replica), as Lightning shards its own samplers: a tensor- or model-parallel
    group's ranks train one replica and need the same batches, so the world size is not the number of shards."""
    kwargs = trainer.distributed_sampler_kwargs if trainer is not None else None
    return (kwargs["num_replicas"], kwargs["rank"]) if kwargs else (1, 0)


def resumable_loader(
    dataset: Dataset,
    batch_size: int,
    collate_fn: Callable,
    trainer: pl.Trainer | None,
    seed: int = 0,
    num_workers: int = 0,
    epoch_indexed: bool = False,
) -> ResumableDataLoader:
    """A shuffled training loader, sharded over the trainer's data-parallel replicas, that resumes mid-epoch."""
    replicas, rank = data_parallel_shard(trainer)
    sampler = ResumableSampler(
        dataset, num_replicas=replicas, rank=rank, shuffle=True, seed=seed, epoch_indexed=epoch_indexed
    )
    loader = ResumableDataLoader(
        dataset,
        batch_size=batch_size,
        sampler=sampler,
        collate_fn=collate_fn,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        generator=torch.Generator(),
    )
    if trainer is not None:
        loader.consumed = lambda: consumed_train_batches(trainer)
    return loader
