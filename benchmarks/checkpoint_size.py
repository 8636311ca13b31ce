"""Size on disk of an adapter-only Lightning checkpoint against a full one, for a QLoRA run.

Run: python benchmarks/run_all.py --only checkpoint_size   (or python benchmarks/checkpoint_size.py)
TinyLlama (hidden 512, 4 layers, ~13M parameters), nf4-dq, LoRA r=8 on all linear layers, AdamW, fp32, 2 steps.
Exact file sizes of ``trainer.save_checkpoint``, no timing.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import lightning.pytorch as pl
import torch
from common import markdown_table, section, write_json

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


def main(argv: list[str] | None = None) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        adapter = checkpoint_bytes(True, Path(folder))
        full = checkpoint_bytes(False, Path(folder))
    section("Lightning checkpoint size, QLoRA TinyLlama (hidden 512, 4 layers), nf4-dq + LoRA r=8")
    print(
        markdown_table(
            ["checkpoint", "bytes", "MB", "ratio to full"],
            [
                ("adapter-only (default)", adapter, f"{adapter / 1e6:.2f}", f"{adapter / full:.2f}"),
                ("full", full, f"{full / 1e6:.2f}", "1.00"),
            ],
        )
    )
    result = {"adapter_only_bytes": adapter, "full_bytes": full, "ratio": adapter / full}
    write_json("checkpoint_size", result)
    return result


if __name__ == "__main__":
    main()
