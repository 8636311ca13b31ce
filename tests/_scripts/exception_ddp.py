"""Regression on 2 DDP CPU processes (gloo), 5 batches an epoch each, saving every 2 steps and on an exception
that ranks RANKS raise as batch 5 starts (step 3 ended with the first epoch, unsaved). A failing rank says when it
raised (``time.time()``). Started as one process, Lightning's launcher starts rank 1.

With a third argument ``OnExceptionCheckpoint``, Lightning's ``OnExceptionCheckpoint(OUT_DIR)`` saves on the
exception instead (the failing ranks' wait shortened to 5 s, as the other way's ``every_rank_wait_s``).

With a fourth, UPDATE_RANKS (comma-separated), RANKS raise in ``on_before_optimizer_step`` of batch 6 instead
(step 4's end, after the gradients' all-reduce) and UPDATE_RANKS' optimizer raises halfway through its update
there.

Usage: python exception_ddp.py OUT_DIR RANKS [save_on_exception|OnExceptionCheckpoint [UPDATE_RANKS]]. Run by
tests/distributed/test_failing_ranks.py.
"""

import sys
import time
import warnings

import lightning.pytorch as pl
from lightning.pytorch.callbacks import OnExceptionCheckpoint
from resume_helpers import FailAt, UpdateRaisesHalfway, fit

import pl_lowprec.distributed.failing_ranks
from pl_lowprec import LowPrecisionDDPStrategy


class SaysWhenItRaised(pl.Callback):
    def on_exception(self, trainer, pl_module, exception):
        print(f"rank {trainer.global_rank} raised at {time.time()}", file=sys.stderr, flush=True)


def _ranks(listed: str) -> set[int]:
    return {int(rank) for rank in listed.split(",")}


def main(out: str, ranks: str, saved_by: str = "save_on_exception", update_ranks: str = "") -> None:
    warnings.filterwarnings("ignore")
    warnings.filterwarnings("always", message=saved_by)
    lightnings = saved_by == "OnExceptionCheckpoint"
    pl_lowprec.distributed.failing_ranks.DEFAULT_WAIT_S = 5.0
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
        schedule={
            "every_n_train_steps": 2,
            **({} if lightnings else {"save_on_exception": True, "every_rank_wait_s": 5.0}),
        },
        callbacks=[
            FailAt("on_before_optimizer_step" if update_ranks else "on_train_batch_start", batch, ranks=_ranks(ranks)),
            SaysWhenItRaised(),
            *([OnExceptionCheckpoint(out)] if lightnings else []),
        ],
    )


if __name__ == "__main__":
    main(*sys.argv[1:5])
