"""``TextDataModule`` on a dataset file (tokenized into an Arrow table) on 2 DDP or FSDP CPU processes (gloo): a
module that records its training batches, and this rank's share of the same records read from a ``.jsonl`` file
(tokenized in memory by each process, as every source was before: the reference).

Usage: python tokenize_once_ddp.py OUT_DIR TOKENIZER RECORDS REFERENCE_JSONL [ddp|fsdp]
Writes OUT_DIR/rank{N}.pt: this rank's process id, its tokenizations, the tables it read, the outcome (``trained
<global step>`` or ``stopped: <message>``), its training batches and the reference's first batches.
Run by tests/data/test_tokenize_once_per_node.py, with the ranks started as torchrun starts them.
"""

import os
import sys
from pathlib import Path

import lightning.pytorch as pl
import torch
from torch import nn

from pl_lowprec import LowPrecisionDDPStrategy, LowPrecisionFSDPStrategy
from pl_lowprec.data import TextDataModule
from pl_lowprec.data import text as text_module

STEPS = 3
DATA_ARGS = {"seq_len": 64, "batch_size": 2, "val_fraction": 0}


class BatchRecorder(pl.LightningModule):
    """A one-layer module whose steps keep the batches they get."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(1, 2, bias=False)  # FSDP's shard unit
        self.batches: list[dict[str, torch.Tensor]] = []

    def training_step(self, batch, batch_idx):
        self.batches.append({name: value.detach().clone() for name, value in batch.items()})
        return self.layer(batch["input_ids"].float().mean().reshape(1, 1)).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def counted(calls: list[str], function, name: str):
    """``function``, each call of it noted in ``calls`` as it starts (a call that raises counts)."""

    def wrapper(*args, **kwargs):
        calls.append(args[0] if name == "read_table" else name)
        return function(*args, **kwargs)

    return wrapper


def main(out: str, tokenizer: str, records: str, reference: str, strategy: str = "ddp") -> None:
    tokenized: list[str] = []
    tables: list[str] = []
    text_module.tokenize = counted(tokenized, text_module.tokenize, "tokenize")
    text_module.read_table = counted(tables, text_module.read_table, "read_table")
    if strategy == "fsdp":
        strategy = LowPrecisionFSDPStrategy(shard_modules="Linear", process_group_backend="gloo")
    else:
        strategy = LowPrecisionDDPStrategy(process_group_backend="gloo")
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=STEPS, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    module = BatchRecorder()
    data = TextDataModule(records, tokenizer, **DATA_ARGS)
    try:
        trainer.fit(module, datamodule=data)
        outcome = f"trained {trainer.global_step}"
    except ValueError as err:
        outcome = f"stopped: {err}"
    expected = []
    if outcome.startswith("trained"):
        own = TextDataModule(reference, tokenizer, **DATA_ARGS)
        own.setup("fit")  # no trainer: this process tokenizes the records itself
        own.trainer = trainer  # its loader takes this rank's shard
        expected = [batch for _, batch in zip(range(STEPS), own.train_dataloader(), strict=False)]
    result = {
        "pid": os.getpid(),
        "tokenized": len(tokenized),
        "tables": tables,
        "outcome": outcome,
        "batches": module.batches,
        "expected": expected,
    }
    torch.save(result, Path(out, f"rank{trainer.global_rank}.pt"))


if __name__ == "__main__":
    main(*sys.argv[1:6])
