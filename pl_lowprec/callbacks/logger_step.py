"""The step Lightning gives its loggers, for figures a callback logs itself at the end of a stage.

Lightning logs ``self.log`` values at ``fit_loop.epoch_loop._batches_that_stepped`` (one per batch that stepped,
however many optimizers stepped in it), not at ``trainer.global_step``, which counts every optimizer's step:
in manual optimization with two optimizers it runs twice as fast, and a figure logged at it landed at step 7
after a per-step series that ended at step 3. Lightning's own ``LearningRateMonitor`` and ``DeviceStatsMonitor``
read the same attribute.
"""

from __future__ import annotations

import lightning.pytorch as pl


def batches_that_stepped(trainer: pl.Trainer) -> int:
    """Lightning's logger step now: the training batches that stepped so far (restored on resume)."""
    return int(trainer.fit_loop.epoch_loop._batches_that_stepped)


def last_training_step_logged(trainer: pl.Trainer) -> int:
    """The step the latest training metrics went to: end-of-fit figures belong with it, as Lightning puts its
    epoch-end metrics there."""
    return max(batches_that_stepped(trainer) - 1, 0)
