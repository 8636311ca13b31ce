"""A resumed run draws the dropout masks of the uninterrupted run: the strategies keep every rank's random states
in the checkpoint and set them as training starts; Lightning's own strategy is the reference that fails."""

import random
import sys
from pathlib import Path

import lightning.pytorch as pl
import numpy as np
import pytest
import torch
import warm_python
from resume_helpers import fit

from pl_lowprec import LowPrecisionStrategy
from pl_lowprec.generator_states import random_states, set_random_states
from pl_lowprec.strategies.random_states import CHECKPOINT_KEY

STOPS = {  # (first run's max_steps, validation interval in batches), in an epoch of 5 steps
    "off_grid": (3, None),
    "on_grid_after_validation": (4, 4),
    "at_the_epochs_end": (5, None),  # the next epoch's loader opens after the save, or after the resumption
}


@pytest.mark.parametrize("stop", STOPS)
@pytest.mark.parametrize(("strategy", "exact"), [("auto", False), ("lowprec", True)], ids=["lightning", "pl_lowprec"])
def test_a_resumed_run_ends_with_the_uninterrupted_runs_weights(tmp_path, stop, strategy, exact):
    first_steps, validate_every = STOPS[stop]
    make = (lambda: LowPrecisionStrategy()) if strategy == "lowprec" else (lambda: "auto")
    uninterrupted = fit(tmp_path / "full", strategy=make(), dropout=0.5, validate_every=validate_every, max_steps=8)
    fit(tmp_path / "run", strategy=make(), dropout=0.5, validate_every=validate_every, max_steps=first_steps)
    last = tmp_path / "run/last.ckpt"
    resumed = fit(
        tmp_path / "run", strategy=make(), dropout=0.5, ckpt_path=last, validate_every=validate_every, max_steps=8
    )
    assert torch.equal(resumed, uninterrupted) is exact


@pytest.mark.parametrize(
    "saved_at", [{"schedule": {}}, {"schedule": {"every_n_train_steps": 5}}], ids=["epoch", "batch"]
)
@pytest.mark.parametrize(("strategy", "exact"), [("auto", False), ("lowprec", True)], ids=["lightning", "pl_lowprec"])
def test_a_plain_shuffled_loader_resumed_where_an_epoch_ended_draws_the_uninterrupted_order(
    tmp_path, saved_at, strategy, exact
):
    """A DataLoader without a generator draws its shuffle and base seed when the next epoch's iterator starts: after
    the checkpoint in the uninterrupted run, before the states are set in the resumed one unless it starts again.
    Saved at the training epoch's end or at its last batch's end (step 5 of a 5-step epoch)."""
    make = (lambda: LowPrecisionStrategy()) if strategy == "lowprec" else (lambda: "auto")
    run = {"dropout": 0.5, "plain_loader": True, **saved_at}
    uninterrupted = fit(tmp_path / "full", strategy=make(), max_steps=8, **run)
    fit(tmp_path / "run", strategy=make(), max_steps=5, **run)
    resumed = fit(tmp_path / "run", strategy=make(), ckpt_path=tmp_path / "run/last.ckpt", max_steps=8, **run)
    assert torch.equal(resumed, uninterrupted) is exact


@pytest.mark.cuda
@pytest.mark.parametrize(("strategy", "exact"), [("auto", False), ("lowprec", True)], ids=["lightning", "pl_lowprec"])
def test_a_resumed_run_on_a_gpu_draws_the_cuda_generators_masks(tmp_path, strategy, exact):
    """On a GPU the dropout masks come from the CUDA generator, a state apart from the CPU's."""
    make = (lambda: LowPrecisionStrategy()) if strategy == "lowprec" else (lambda: "auto")
    uninterrupted = fit(tmp_path / "full", strategy=make(), accelerator="gpu", dropout=0.5, max_steps=8)
    fit(tmp_path / "run", strategy=make(), accelerator="gpu", dropout=0.5, max_steps=3)
    resumed = fit(
        tmp_path / "run",
        strategy=make(),
        accelerator="gpu",
        dropout=0.5,
        ckpt_path=tmp_path / "run/last.ckpt",
        max_steps=8,
    )
    assert torch.equal(resumed, uninterrupted) is exact
    if exact:  # the CUDA generator's state travelled in the checkpoint
        (states,) = torch.load(tmp_path / "run/last.ckpt", weights_only=True)[CHECKPOINT_KEY]
        assert "cuda" in states


def test_the_states_load_with_weights_only_and_set_every_generator(tmp_path):
    fit(tmp_path, strategy=LowPrecisionStrategy(), dropout=0.5, max_steps=1)
    (states,) = torch.load(tmp_path / "last.ckpt", weights_only=True)[CHECKPOINT_KEY]  # one rank
    saved = random_states()
    draws = (torch.rand(3), random.random(), np.random.rand())
    set_random_states(saved)
    again = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(draws[0], again[0]) and draws[1:] == again[1:]
    assert set(states) >= {"torch", "python", "numpy"}


@pytest.mark.slow
def test_each_ddp_rank_resumes_its_own_masks(tmp_path):
    script = Path(__file__).parents[1] / "_scripts" / "random_states_ddp.py"
    for mode in ("full", "resumed"):
        command = [sys.executable, str(script), mode, str(tmp_path / mode)]
        result = warm_python.run(command, 300, ranks=2, pythonpath=script.parents[1])
        assert result.returncode == 0, result.stderr[-4000:]
    for rank in (0, 1):
        full, resumed = (torch.load(tmp_path / mode / f"weights{rank}.pt") for mode in ("full", "resumed"))
        assert torch.equal(resumed, full), rank


class TrainingLosses(pl.Callback):
    """Every training batch's loss, by the batch's place in the run (``global_step`` and the micro-batch)."""

    def __init__(self) -> None:
        self.losses: dict[tuple[int, int, int], float] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses[(trainer.current_epoch, batch_idx, trainer.global_step)] = outputs["loss"].item()


VALIDATION_AFTER_THE_CHECKPOINT = {  # (first run's max_steps, whole run's max_steps, fit's arguments)
    # saved at an epoch's boundary, restarted there: Lightning skips a validation it takes to be pending, and opens
    # the validation loader's iterator to do so (a draw from the global generator); the uninterrupted run made it
    # only where a validation followed the checkpoint
    "at_the_validations_end_after_the_epochs_last_batch": (
        5,
        8,
        {"schedule": {}, "validate_every": 1.0, "shuffled_validation": False},
    ),
    "the_epochs_last_batch_without_a_validation_after": (
        5,
        8,
        {"schedule": {"every_n_train_steps": 5}, "validate_every": 3, "shuffled_validation": False},
    ),
    # a step save that a validation follows, which a shuffled validation loader draws through
    "shuffled_at_the_epochs_end": (5, 12, {"schedule": {"every_n_train_steps": 5}, "validate_every": 1.0}),
    "shuffled_inside_the_epoch": (8, 12, {"schedule": {"every_n_train_steps": 8}, "validate_every": 3}),
    # every other epoch validates: a step save at epoch 1's end, followed by its validation
    "every_second_epoch_at_a_validating_epochs_end": (
        10,
        17,
        {"schedule": {"every_n_train_steps": 5}, "validate_every": 1.0, "check_val_every_n_epoch": 2},
    ),
    # the run stops at epoch 0's end, where no validation is due: Lightning's save_last at the train's end
    "every_second_epoch_saved_after_the_fit": (
        5,
        12,
        {"schedule": {}, "validate_every": 1.0, "check_val_every_n_epoch": 2},
    ),
}


@pytest.mark.parametrize("case", VALIDATION_AFTER_THE_CHECKPOINT)
def test_a_run_resumed_before_a_validation_trains_with_the_uninterrupted_losses(tmp_path, case):
    """Restarted at an epoch's boundary, Lightning skips a validation it takes to be pending and opens the
    validation loader's iterator to do so, a draw the uninterrupted run made only where it validated right after the
    checkpoint; there it drew more (a shuffled loader's ``RandomSampler`` seed at its first batch) or counted an
    epoch, inside an epoch too. The resumed run's dropout masks were one draw off (and, from a file saved after the
    fit ended, its epochs one off): every resumed loss must be the uninterrupted run's, bit for bit."""
    stop, total, run = VALIDATION_AFTER_THE_CHECKPOINT[case]
    run = {"dropout": 0.5, "shuffled_validation": True, **run}
    full, resumed = TrainingLosses(), TrainingLosses()
    uninterrupted = fit(tmp_path / "full", strategy=LowPrecisionStrategy(), max_steps=total, callbacks=[full], **run)
    fit(tmp_path / "run", strategy=LowPrecisionStrategy(), max_steps=stop, **run)
    last = tmp_path / "run/last.ckpt"
    assert torch.load(last, weights_only=False)["global_step"] == stop
    weights = fit(
        tmp_path / "run", strategy=LowPrecisionStrategy(), ckpt_path=last, max_steps=total, callbacks=[resumed], **run
    )
    assert len(resumed.losses) == 2 * (total - stop)
    assert resumed.losses == {place: full.losses[place] for place in resumed.losses}
    assert torch.equal(weights, uninterrupted)
