"""Size on disk of an adapter-only Lightning checkpoint against a full one, for a QLoRA run.

Run: python benchmarks/checkpoint_size.py
TinyLlama (hidden 512, 4 layers, ~11M parameters), nf4-dq, LoRA r=8 on all linear layers, AdamW, 2 steps on CPU.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import lightning.pytorch as pl
import torch
from common import markdown_table, write_json

from pl_lowprec import LowPrecisionStrategy
from pl_lowprec.demo import TinyLlama


def checkpoint_bytes(adapter_only: bool, folder: Path) -> int:
    ids = torch.randint(0, 256, (8, 65), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader([{"input_ids": r} for r in ids], batch_size=4)
    strategy = LowPrecisionStrategy(
        quantization="nf4-dq", lora={"r": 8, "lora_alpha": 16}, adapter_only_checkpoint=adapter_only
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        strategy=strategy,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyLlama(hidden_size=512, intermediate_size=1408, num_layers=4, num_heads=8), loader)
    path = folder / f"adapter_only_{adapter_only}.ckpt"
    trainer.save_checkpoint(path)
    return path.stat().st_size


def main() -> dict:
    with tempfile.TemporaryDirectory() as folder:
        adapter = checkpoint_bytes(True, Path(folder))
        full = checkpoint_bytes(False, Path(folder))
    print("Lightning checkpoint size, QLoRA TinyLlama (hidden 512, 4 layers), nf4-dq + LoRA r=8\n")
    print(
        markdown_table(
            ["checkpoint", "bytes", "ratio to full"],
            [("adapter-only (default)", adapter, adapter / full), ("full", full, 1.0)],
        )
    )
    result = {"adapter_only_bytes": adapter, "full_bytes": full, "ratio": adapter / full}
    write_json("checkpoint_size", result)
    return result


if __name__ == "__main__":
    main()
