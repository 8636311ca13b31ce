"""Regression with dropout on 2 DDP CPU processes (gloo): 8 steps, or 3 steps then resumed from last.ckpt to 8.

Usage: python random_states_ddp.py {full|resumed} OUT_DIR   Writes OUT_DIR/weights{rank}.pt.
Run by tests/strategies/test_random_states.py.
"""

import os
import sys
import warnings

import torch
from resume_helpers import fit

from pl_lowprec import LowPrecisionDDPStrategy


def main(mode: str, out: str) -> None:
    warnings.filterwarnings("ignore")
    strategy = LowPrecisionDDPStrategy(process_group_backend="gloo")
    # each rank its own seed: a resumption that gave a rank another rank's states would draw other masks
    common = {
        "devices": 2,
        "use_distributed_sampler": False,
        "seed": 123 + int(os.environ["LOCAL_RANK"]),
        "dropout": 0.5,
    }
    if mode == "resumed":
        fit(f"{out}/ckpts", strategy=strategy, max_steps=3, **common)
        strategy = LowPrecisionDDPStrategy(process_group_backend="gloo")
        weights = fit(f"{out}/ckpts", strategy=strategy, ckpt_path=f"{out}/ckpts/last.ckpt", max_steps=8, **common)
    else:
        weights = fit(f"{out}/ckpts", strategy=strategy, max_steps=8, **common)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    torch.save(weights, f"{out}/weights{rank}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:3])
