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
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.trainer.states import TrainerFn

from pl_lowprec.generator_states import generators_held

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


def hold_random_states_through_the_skipped_validation(trainer: Any, validation_followed: bool | None) -> bool:
    """Where no validation followed the checkpoint (its ``CHECKPOINT_KEY``), make the validation Lightning skips
    next draw nothing (once); whether it did. A checkpoint that does not say (``None``: written before this check
    existed) is left to Lightning."""
    if validation_followed is not False:
        return False
    val_loop = trainer.fit_loop.epoch_loop.val_loop
    skip = val_loop.increment_progress_to_evaluation_end

    def skip_holding_the_generators() -> None:
        del val_loop.increment_progress_to_evaluation_end  # once: Lightning's own method again
        with generators_held():
            skip()

    val_loop.increment_progress_to_evaluation_end = skip_holding_the_generators
    return True
