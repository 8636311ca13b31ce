"""The regression of ``resume_helpers`` on 2 DDP CPU processes (gloo), resumed from a 1-process checkpoint to 6 steps
(its plain loader: ``resumable_loader`` refuses another number of ranks).

Usage: python run_record_ddp.py ONE_PROCESS_CKPT OUT_DIR   Writes OUT_DIR/said{rank}.txt (the warnings that say a
changed run, one a line) and OUT_DIR/two/last.ckpt (the 2 processes' checkpoint). Run by
tests/strategies/test_run_record.py.
"""

import sys
import warnings
from pathlib import Path

import torch
from resume_helpers import fit

from pl_lowprec import LowPrecisionDDPStrategy

SAID = "with other settings than that checkpoint was saved with"


def main(one_process_checkpoint: str, out: str) -> None:
    strategy = LowPrecisionDDPStrategy(process_group_backend="gloo")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(
            f"{out}/two",
            strategy=strategy,
            ckpt_path=one_process_checkpoint,
            max_steps=6,
            devices=2,
            use_distributed_sampler=False,
            plain_loader=True,
        )
    said = [str(w.message) for w in caught if SAID in str(w.message)]
    Path(f"{out}/said{torch.distributed.get_rank()}.txt").write_text("\n".join(said))


if __name__ == "__main__":
    main(*sys.argv[1:3])
