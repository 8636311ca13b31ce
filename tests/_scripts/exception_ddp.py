"""Regression on 2 DDP CPU processes (gloo), 5 batches an epoch each, saving every 2 steps and on an exception
that ranks RANKS raise as batch 5 starts (step 3 ended with the first epoch, unsaved). A failing rank says each
time it asks the other ranks. Started as one process, Lightning's launcher starts rank 1.

With a third argument ``save_on_exception,OnExceptionCheckpoint``, Lightning's ``OnExceptionCheckpoint(OUT_DIR)``
saves on the exception too (the failing ranks' wait shortened to 5 s, as ``every_rank_wait_s``).

With a fourth, UPDATE_RANKS (comma-separated), RANKS raise in ``on_before_optimizer_step`` of batch 6 instead
(step 4's end, after the gradients' all-reduce) and UPDATE_RANKS' optimizer raises halfway through its update
there.

Usage: python exception_ddp.py OUT_DIR RANKS [save_on_exception[,OnExceptionCheckpoint] [UPDATE_RANKS]]. Run by
tests/distributed/test_failing_ranks.py.
"""

import sys
import warnings

import torch.distributed as dist
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from resume_helpers import FailAt, UpdateRaisesHalfway, fit

from pl_lowprec import LowPrecisionDDPStrategy
from pl_lowprec.distributed import failing_ranks


def _saying_each_ask(ask):
    def ask_the_store(place, update_interrupted, wait_s):
        print(f"rank {dist.get_rank()} asks the other ranks", file=sys.stderr, flush=True)
        return ask(place, update_interrupted, wait_s)

    return ask_the_store


def _ranks(listed: str) -> set[int]:
    return {int(rank) for rank in listed.split(",")}


def main(out: str, ranks: str, saved_by: str = "save_on_exception", update_ranks: str = "") -> None:
    warnings.filterwarnings("ignore")
    for callback in saved_by.split(","):
        warnings.filterwarnings("always", message=callback)
    lightnings = "OnExceptionCheckpoint" in saved_by.split(",")
    failing_ranks.DEFAULT_WAIT_S = 5.0
    failing_ranks._ask_the_store = _saying_each_ask(failing_ranks._ask_the_store)
    batch = 6 if update_ranks else 5
    UpdateRaisesHalfway.failing_batch = batch if update_ranks else None
    UpdateRaisesHalfway.failing_ranks = _ranks(update_ranks) if update_ranks else None
    fit(
        out,
        strategy=LowPrecisionDDPStrategy(process_group_backend="gloo"),
        devices=2,
        use_distributed_sampler=False,
        max_steps=8,
        dropout=0.5,
        module_class=UpdateRaisesHalfway,
        schedule={"every_n_train_steps": 2, "save_on_exception": True, "every_rank_wait_s": 5.0},
        callbacks=[
            FailAt("on_before_optimizer_step" if update_ranks else "on_train_batch_start", batch, ranks=_ranks(ranks)),
            *([OnExceptionCheckpoint(out)] if lightnings else []),
        ],
    )


if __name__ == "__main__":
    main(*sys.argv[1:5])
