"""TinyGPT on 2 DDP CPU processes (gloo) whose own loaders give 7 and 6 batches (``use_distributed_sampler=False``).

Usage: python uneven_batches_ddp.py OUT_DIR MAX_STEPS   (MAX_STEPS -1: the whole epoch)
Writes OUT_DIR/rank{N}.txt: "error: <message>" or "steps: <global_step>". Run by
tests/distributed/test_equal_batches.py.
"""

import os
import sys
import warnings

import lightning.pytorch as pl
import torch

from pl_lowprec import LowPrecisionDDPStrategy
from pl_lowprec.demo import TinyGPT


def main(out: str, max_steps: str) -> None:
    warnings.filterwarnings("ignore")
    rank = int(os.environ.get("LOCAL_RANK", 0))
    ids = torch.randint(0, 256, (7 - rank, 2, 17), generator=torch.Generator().manual_seed(rank))
    loader = torch.utils.data.DataLoader([{"input_ids": row} for row in ids], batch_size=None)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=LowPrecisionDDPStrategy(process_group_backend="gloo"),
        max_epochs=1,
        max_steps=int(max_steps),
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=out,
    )
    try:
        trainer.fit(TinyGPT(dim=32, layers=1, heads=2, max_len=32), loader)
        said = f"steps: {trainer.global_step}"
    except ValueError as err:
        said = f"error: {err}"
    with open(f"{out}/rank{rank}.txt", "w") as file:
        file.write(said)


if __name__ == "__main__":
    main(*sys.argv[1:3])
