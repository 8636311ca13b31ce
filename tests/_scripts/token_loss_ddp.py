"""One optimizer step of TokenMeanLlama on 2 DDP CPU processes (gloo), accumulating 2 micro-batches of 2 rows.

Usage: python token_loss_ddp.py OUT_DIR   Writes OUT_DIR/rank{N}.pt with the parameters after the step and the
step's loss (``step_losses``).
Rank r trains on rows [4r, 4r + 4) of uneven_rows(8): the window is all 8 rows. Run by tests/models/test_token_loss.py.
"""

import os
import sys
import warnings

import lightning.pytorch as pl
import torch
from token_loss_helpers import TokenMeanLlama, uneven_rows

from pl_lowprec import LowPrecisionDDPStrategy


def main(out: str) -> None:
    warnings.filterwarnings("ignore")
    rank = int(os.environ.get("LOCAL_RANK", 0))
    rows = uneven_rows(8)[4 * rank : 4 * rank + 4]
    loader = torch.utils.data.DataLoader(rows, batch_size=2)
    model = TokenMeanLlama()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=LowPrecisionDDPStrategy(process_group_backend="gloo"),
        max_steps=1,
        accumulate_grad_batches=2,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save({**state, "step_losses": model.step_losses}, f"{out}/rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
