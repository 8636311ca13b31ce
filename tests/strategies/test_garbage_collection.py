"""Before the first step the strategy collects garbage once and freezes what survives; teardown unfreezes.

A full garbage collection walks every object the process holds (half a million after importing torch,
transformers and Lightning): the stall the freeze removes from the middle of training."""

import gc
import logging
import weakref

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import LearningRateFinder
from lightning_helpers import quiet_trainer

from pl_lowprec import LowPrecisionStrategy
from pl_lowprec.demo.tiny_gpt import TinyGPT


class _Cycle:
    """An object in a reference cycle: only the garbage collector frees it."""

    def __init__(self) -> None:
        self.me = self


class FrozenDuringTraining(pl.Callback):
    def __init__(self, garbage: weakref.ref) -> None:
        self.garbage = garbage
        self.frozen: list[int] = []
        self.garbage_alive: list[bool] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.frozen.append(gc.get_freeze_count())
        self.garbage_alive.append(self.garbage() is not None)


@pytest.fixture(autouse=True)
def _nothing_frozen_by_the_test_process():
    """Lift conftest's freeze of the test process for these tests: they watch the strategy's own."""
    gc.unfreeze()
    yield
    gc.collect()
    gc.freeze()


def _fit(callback: pl.Callback, strategy=None) -> None:
    torch.manual_seed(0)
    model = TinyGPT(dim=16, layers=1, heads=2, max_len=32, warmup_steps=1)
    ids = torch.randint(0, 256, (8, 17))
    loader = torch.utils.data.DataLoader([{"input_ids": r} for r in ids], batch_size=4)
    trainer = quiet_trainer(strategy=strategy or LowPrecisionStrategy(), max_steps=2, callbacks=[callback])
    trainer.fit(model, loader)


def test_what_lives_through_training_is_frozen_after_the_garbage_is_collected(caplog):
    garbage = _Cycle()
    callback = FrozenDuringTraining(weakref.ref(garbage))
    del garbage  # unreachable now, but still alive: a cycle waits for a collection
    gc.disable()  # no collection may happen by chance before the strategy's own
    try:
        with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
            _fit(callback)
    finally:
        gc.enable()
    assert len(callback.frozen) == 2 and all(n > 10_000 for n in callback.frozen)  # torch alone holds more
    assert callback.garbage_alive == [False, False]  # collected before freezing: no garbage kept for good
    assert gc.get_freeze_count() == 0  # teardown unfroze them
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Froze the ")]
    assert len(said) == 1 and "Python objects alive before the first step (gc.freeze" in said[0]


def test_a_freeze_made_by_someone_else_is_left_alone(caplog):
    gc.freeze()
    try:
        before = gc.get_freeze_count()
        callback = FrozenDuringTraining(weakref.ref(_Cycle()))
        with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
            _fit(callback)
        # frozen objects that die leave the permanent generation; none joined it, and it was not emptied
        assert all(0 < n <= before for n in [*callback.frozen, gc.get_freeze_count()])
        assert "Froze the " not in caplog.text
    finally:
        gc.unfreeze()


def test_a_learning_rate_finder_in_the_fit_leaves_nothing_frozen():
    """``LearningRateFinder`` runs trial steps in ``on_fit_start``: training starts twice in one fit, and the
    second start found the first freeze and took it for someone else's, so teardown unfroze nothing."""
    _fit(LearningRateFinder(num_training_steps=2, update_attr=False))
    assert gc.get_freeze_count() == 0
