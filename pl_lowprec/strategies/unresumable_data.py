"""A resumption inside an epoch whose training loader cannot start part-way, said with the fix.

Lightning saves a training loader's position only where the loader has ``state_dict``/``load_state_dict``; a plain
``DataLoader`` starts the epoch's data again, so the resumed run draws the rest of the epoch from a new pass (a new
shuffle) and does not go on as the uninterrupted run would. Lightning warns in general terms; this package has
the loader that fixes it (``pl_lowprec.data.resumable_loader``), so the warning here names it, with the numbers.
"""

from __future__ import annotations

import warnings
from typing import Any

from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader, RandomSampler

LIGHTNINGS_WARNING = "You're resuming from a checkpoint that ended before the epoch ended"


def resumed_where_an_epoch_ended(trainer: Any) -> bool:
    """Whether a resumed ``fit``, as it starts training, stands where an epoch's batches all ran (its next
    batch opens a new epoch); ``False`` for an endless loader."""
    batches = trainer.num_training_batches
    return batches != float("inf") and trainer.fit_loop.epoch_loop.batch_progress.current.ready >= batches


def unresumable_data_paragraph(trainer: Any) -> str | None:
    """The warning's text where a resumed ``fit`` starts inside an epoch on a loader without state; else ``None``."""
    batches = trainer.num_training_batches
    combined = trainer.fit_loop._combined_loader
    if combined is None or batches == float("inf"):
        return None
    if resumed_where_an_epoch_ended(trainer):
        return None  # a new epoch starts anyway
    plain = [loader for loader in combined.flattened if not isinstance(loader, _Stateful)]
    if not plain:
        return None
    shuffled = any(isinstance(getattr(loader, "sampler", None), RandomSampler) for loader in plain)
    kinds = ", ".join(sorted({_kind(loader) for loader in plain}))
    done = trainer.fit_loop.epoch_loop.batch_progress.current.processed
    return (
        f"This run resumes at step {trainer.global_step}, inside epoch {trainer.current_epoch} ({done} of its"
        f" {batches} batches done), but the training loader ({kinds}) has no state to resume from (no"
        " state_dict/load_state_dict): Lightning draws the rest of the epoch from a new pass over the data"
        f"{' (a new shuffle)' if shuffled else ' (its first batches again)'}, so the run does not go on as the"
        " uninterrupted one would. For an exact resumption, build the training loader with"
        " pl_lowprec.data.resumable_loader(dataset, batch_size, collate_fn, self.trainer, seed=...), which starts an"
        " epoch part-way, or resume from a checkpoint saved where an epoch ended."
    )


def warn_unresumable_data(trainer: Any) -> None:
    """The paragraph as a warning (rank zero) where it applies, in place of Lightning's general one."""
    paragraph = unresumable_data_paragraph(trainer)
    if paragraph is not None:
        warnings.filterwarnings("ignore", message=LIGHTNINGS_WARNING)
        rank_zero_warn(paragraph)


def _kind(loader: Any) -> str:
    sampler = getattr(loader, "sampler", None)
    return (
        f"{type(loader).__name__} with {type(sampler).__name__}"
        if isinstance(loader, DataLoader)
        else type(loader).__name__
    )
