"""A user's module (``packing_helpers.HFUser``) with ``TextDataModule(packing=True)`` on 2 DDP CPU processes (gloo):
both processes run the packing check's forwards together, and both stop when it finds a leak.

Usage: python packing_guard_ddp.py OUT_DIR PRETRAINED RECORDS CALL [ddp|fsdp]
(fsdp: LowPrecisionFSDPStrategy, nf4 base weights and LoRA adapters, decoder layers sharded)
Writes OUT_DIR/rank{N}.txt: ``trained <global step>``, or ``stopped: <message>``.
Run by tests/data/test_packing_guard.py; Lightning's DDP launcher re-runs this script for rank 1.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # packing_helpers

import lightning.pytorch as pl
from packing_helpers import HFUser

from pl_lowprec import LowPrecisionFSDPStrategy
from pl_lowprec.data import TextDataModule


def main(out: str, pretrained: str, records: str, call: str, strategy: str = "ddp") -> None:
    data = TextDataModule(records, pretrained, seq_len=64, batch_size=2, val_fraction=0, packing=True)
    if strategy == "fsdp":
        lora = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}
        strategy = LowPrecisionFSDPStrategy(
            quantization="nf4", lora=lora, shard_modules="LlamaDecoderLayer", process_group_backend="gloo"
        )
    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_steps=2, limit_val_batches=0, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    module = HFUser(pretrained, train_call=call)
    try:
        trainer.fit(module, datamodule=data)
        outcome = f"trained {trainer.global_step}"
    except ValueError as err:
        outcome = f"stopped: {err}"
    Path(out, f"rank{trainer.global_rank}.txt").write_text(outcome)


if __name__ == "__main__":
    main(*sys.argv[1:6])
