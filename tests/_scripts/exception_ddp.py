"""Regression on 2 DDP CPU processes (gloo), 5 batches an epoch each, saving every 2 steps and on an exception
that ranks RANKS raise as batch 5 starts (step 3 ended with the first epoch, unsaved).

Usage: python exception_ddp.py OUT_DIR RANKS (comma-separated). Run by tests/distributed/test_failing_ranks.py.
"""

import sys
import warnings

from resume_helpers import FailAt, fit

import pl_lowprec.distributed.failing_ranks
from pl_lowprec import LowPrecisionDDPStrategy


def main(out: str, ranks: str) -> None:
    warnings.filterwarnings("ignore")
    warnings.filterwarnings("always", message="save_on_exception")
    pl_lowprec.distributed.failing_ranks.EVERY_RANK_WAIT_S = 5.0
    fit(
        out,
        strategy=LowPrecisionDDPStrategy(process_group_backend="gloo"),
        devices=2,
        use_distributed_sampler=False,
        max_steps=8,
        dropout=0.5,
        schedule={"every_n_train_steps": 2, "save_on_exception": True},
        callbacks=[FailAt("on_train_batch_start", 5, ranks={int(rank) for rank in ranks.split(",")})],
    )


if __name__ == "__main__":
    main(*sys.argv[1:3])
