"""The validation Lightning skips on a restart at an epoch's boundary draws nothing from the random generators unless
the uninterrupted run validated there too.

Restarted at an epoch's boundary, Lightning 2.6 asks its "validate now?" question once more before the next epoch's
first batch (at ``batch_idx == -1``, where every interval divides) and, taking a validation to be pending, sets the
validation counters to its end (``_EvaluationLoop.increment_progress_to_evaluation_end``). That opens the validation
loader's iterator, and a ``DataLoader`` without a ``generator`` (the usual validation loader) draws its base seed
from the global generator then. The uninterrupted run made that draw only where it validated after the checkpoint
was written (the epoch's last batch on the validation grid); saved at a validation's end (``val_check_interval=1.0``,
Lightning's default checkpoint schedule) or off the grid, it did not, and the resumed run's dropout masks were shifted
by one draw from then on. So the checkpoint says whether a validation followed it, and where none did, the skipped
one is made with the generators held.

Where one did follow (a step save on the validation grid, at an epoch's end or inside it), the uninterrupted run drew
more than the skip does: a shuffled validation loader's ``RandomSampler`` without its own generator draws its seed
from the global generator at the first batch, which the skip never fetches; a second validation loader's iterator
is never opened; and with ``check_val_every_n_epoch > 1`` Lightning does not ask (the epoch it resumes in is not
one that validates), so nothing is drawn. Inside an epoch the skip then makes the missing draws; at an epoch's end
they are all made as training starts, before the next epoch's loader draws (as in the uninterrupted run), and the
skip, if Lightning makes one, draws nothing.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.data import DataLoader

from pl_lowprec.generator_states import generators_held
from pl_lowprec.strategies.unresumable_data import resumed_where_an_epoch_ended

CHECKPOINT_KEY = "pl_lowprec_validation_follows"


def validation_follows(trainer: Any) -> bool:
    """Whether the fit loop validates after a checkpoint written now and before the next training batch: written at
    a training batch's end on the validation grid (not during a validation, nor at an epoch's end)."""
    if trainer.state.fn != TrainerFn.FITTING or trainer.validating or trainer.sanity_checking:
        return False
    loop = trainer.fit_loop.epoch_loop
    progress = loop.batch_progress.current
    if progress.processed != progress.completed + 1 or loop._skip_next_val:  # not inside on_train_batch_end
        return False
    return bool(loop._should_check_val_fx(trainer.fit_loop._data_fetcher))


def replay_the_skipped_validations_draws(trainer: Any, validation_followed: bool | None) -> None:
    """Make the random generators, from the restored states on, draw what the uninterrupted run drew through the
    validation Lightning skips on this restart (``CHECKPOINT_KEY``: whether one followed the checkpoint). Call it as
    training starts, before the training loader's iterator is opened again. A checkpoint that does not say
    (``None``: written before this check existed) is left to Lightning."""
    if validation_followed is None:
        return
    val_loop = trainer.fit_loop.epoch_loop.val_loop
    at_an_epochs_end = resumed_where_an_epoch_ended(trainer)
    if not (validation_followed or at_an_epochs_end):
        return  # inside an epoch, Lightning skips only a validation that followed the checkpoint
    if validation_followed and at_an_epochs_end:
        draw_as_the_validation(trainer, val_loop, first_opened=False)
    skip = val_loop.increment_progress_to_evaluation_end

    def skip_drawing_as_the_uninterrupted_run() -> None:
        del val_loop.increment_progress_to_evaluation_end  # once: Lightning's own method again
        if at_an_epochs_end:
            with generators_held():
                skip()
            return
        skip()
        draw_as_the_validation(trainer, val_loop, first_opened=True)

    val_loop.increment_progress_to_evaluation_end = skip_drawing_as_the_uninterrupted_run


def draw_as_the_validation(trainer: Any, val_loop: Any, first_opened: bool) -> None:
    """What a validation draws before its first step, less the first loader's base seed where ``first_opened``
    (drawn as Lightning's skip opened that loader's iterator): for every loader, the base seed as its iterator
    opens and the first index of its sampler (a ``RandomSampler`` without a generator draws its seed there; with
    workers, as the iterator opens). A loader that is no ``DataLoader`` is left alone (its draws are unknown)."""
    if val_loop._combined_loader is None:  # Lightning loads it where the resumed epoch validates: load it as it does
        trainer.validating = True
        val_loop.setup_data()
        trainer.training = True
    combined = val_loop._combined_loader
    if combined is None or val_loop.skip:
        return
    iterators = getattr(getattr(combined, "_iterator", None), "iterators", None) or []
    limits = combined.limits or [None] * len(combined.flattened)
    for number, (loader, limit) in enumerate(zip(combined.flattened, limits, strict=True)):
        if not isinstance(loader, DataLoader) or limit == 0:
            continue
        iterator = iterators[0] if number == 0 and first_opened and iterators else iter(loader)
        indices = getattr(iterator, "_sampler_iter", None)
        if indices is not None:
            next(indices, None)
