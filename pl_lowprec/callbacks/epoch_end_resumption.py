"""A checkpoint saved at a training epoch's end, resumed by a ``max_steps`` run as Lightning resumes one saved at the
epoch's last batch.

Lightning 2.6 treats every ``max_steps`` run as restarting (``_FitLoop.restarting`` is forced on for
iteration-based training), and a checkpoint saved in ``on_train_epoch_end`` (``ModelCheckpoint``'s default schedule
where no validation runs at the epoch's end) then restores as "restarted on the epoch's end": the epoch loop, its
batches all done, runs one more batch (the next epoch's first, alone in its accumulation window, as
``batch_idx == num_batches``) and then starts another epoch, so the rest of the next epoch is never trained. The same
state saved one hook earlier, at the last batch's end (``every_n_train_steps`` on that step), resumes exactly: a new
epoch from its first batch. The two states differ only in counters that the epoch's end advances: the last batch
counted as completed, the epoch counted as processed, and the logging step. ``as_saved_at_the_last_batch``
sets those back, in the checkpoint as it is read, before Lightning restores its loops.

A file written after the epoch's end also counts the epoch as completed: ``ModelCheckpoint``'s ``save_last`` in
``on_train_end`` where no save fell on the run's last epoch end (``check_val_every_n_epoch=2`` and ``max_steps`` in
an epoch without validation), or ``trainer.save_checkpoint`` after ``fit``. Lightning resumes it with an empty epoch
(its counters say every batch ran) and trains from the epoch after: the epoch counter runs one ahead of the
uninterrupted run's, so every epoch-based decision (``check_val_every_n_epoch``, an epoch scheduler, a sampler's
``set_epoch``) falls an epoch off. It is set back the same way.

Checked against the uninterrupted run (``tests/callbacks/test_step_boundary_checkpoint.py``): the weights, with an
epoch-interval learning-rate scheduler too, which steps once at that epoch's end in both.
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info


def saved_at_a_training_epochs_end(fit_loop: MutableMapping[str, Any]) -> bool:
    """Whether ``fit_loop`` (a checkpoint's ``loops.fit_loop``) was saved in ``on_train_epoch_end`` or after it:
    every batch of the epoch completed, the epoch processed (and maybe completed: ``on_train_end``)."""
    epochs = fit_loop.get("epoch_progress", {}).get("total", {})
    batches = fit_loop.get("epoch_loop.batch_progress", {})
    total, current = batches.get("total", {}), batches.get("current", {})
    epoch_processed = epochs.get("ready") == epochs.get("started") == epochs.get("processed", 0) > 0
    epoch_open = epochs.get("completed") in (epochs.get("processed", 0) - 1, epochs.get("processed"))
    counters = ("ready", "started", "processed", "completed")
    batches_done = all(total.get(c) == total.get("ready") for c in counters) and current.get("completed", 0) > 0
    batches_done = batches_done and all(current.get(c) == current.get("ready") for c in counters)
    return epoch_processed and epoch_open and batches_done and bool(batches.get("is_last_batch"))


def as_saved_at_the_last_batch(checkpoint: MutableMapping[str, Any], max_steps: int) -> bool:
    """Rewrite, in place, the loop state of a checkpoint saved at a training epoch's end into the state saved at
    the epoch's last batch's end, where ``max_steps`` makes Lightning resume it as restarting; whether it did (said
    in one line). The strategies call it before Lightning restores the loops, and so does ``StepBoundaryCheckpoint``
    for any strategy; the second call finds nothing to do."""
    fit_loop = checkpoint.get("loops", {}).get("fit_loop")
    if max_steps == -1 or not isinstance(fit_loop, MutableMapping) or not saved_at_a_training_epochs_end(fit_loop):
        return False
    batches = fit_loop["epoch_loop.batch_progress"]
    for counters in (batches["total"], batches["current"]):
        counters["completed"] -= 1
    for counters in (fit_loop["epoch_progress"]["total"], fit_loop["epoch_progress"]["current"]):
        counters["processed"] = counters["completed"] = counters["started"] - 1  # started, as at its last batch
    state = fit_loop.get("epoch_loop.state_dict", {})
    if "_batches_that_stepped" in state:
        state["_batches_that_stepped"] -= 1
    rank_zero_info(
        "The checkpoint was saved at a training epoch's end: the run goes on from the next epoch's first batch"
        " (resumed as saved at the epoch's last batch; Lightning alone would train one batch of the next epoch and"
        " skip the rest of it under max_steps)."
    )
    return True
