"""What keeping activations in the compute dtype changes in training (``transforms/autocast_activations.py``).

Run: python benchmarks/activation_dtype.py [--steps 60]

Under bf16-mixed with LoRA, pl_lowprec keeps norm outputs (and so the residual stream) in bf16, lets LoRA read its
input as it is, and recomputes norms in backward. Of these, only the bf16 residual stream changes numbers: the
adapters' matmuls read bf16 either way, and a recomputed norm runs the same ops. This fine-tunes the demo's
pretrained model (``pl-lowprec make-demo-model``, made here first) with ``configs/finetune-causal-lm.yaml``'s
settings (nf4-dq, LoRA r=8 on all linear layers, every block checkpointed, loss in chunks of 256, lr 3e-3,
accumulation 2) under bf16-mixed, twice from the same seed: with the hooks (as shipped) and without them (fp32
norm outputs and residual stream, as before). It prints both loss curves' difference and the validation loss.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import torch
from common import describe_machine, machine_info, markdown_table, quiet_trainer, section, write_json
from lightning.pytorch import seed_everything
from lightning.pytorch.callbacks import Callback

import pl_lowprec.transforms.pipeline as pipeline
from pl_lowprec import LowPrecisionStrategy
from pl_lowprec.data import TextDataModule
from pl_lowprec.demo.pretrained import make_demo_model
from pl_lowprec.models import CausalLM

SHIPPED = "bf16 activations (shipped)"
BEFORE = "fp32 norm outputs and residual (before)"


class Losses(Callback):
    def __init__(self) -> None:
        self.train: list[float] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.train.append(float(trainer.callback_metrics["train/loss"]))


def fine_tune(demo: Path, steps: int, hooks: bool) -> dict[str, Any]:
    keep = pipeline.keep_activations_in_compute_dtype
    if not hooks:
        pipeline.keep_activations_in_compute_dtype = lambda model, **kwargs: 0  # the path before them
    try:
        seed_everything(0, verbose=False)
        data = TextDataModule(
            train_files=demo / "data/train.jsonl",
            val_files=demo / "data/val.jsonl",
            tokenizer=str(demo / "model"),
            seq_len=256,
            batch_size=8,
        )
        strategy = LowPrecisionStrategy(
            quantization="nf4-dq",
            lora={"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": "all-linear"},
            activation_checkpointing=["LlamaDecoderLayer"],
        )
        losses = Losses()
        trainer = quiet_trainer(
            strategy=strategy,
            precision="bf16-mixed",
            max_steps=steps,
            accumulate_grad_batches=2,
            callbacks=[losses],
            limit_val_batches=1.0,
            val_check_interval=None,
            check_val_every_n_epoch=None,
        )
        model = CausalLM(str(demo / "model"), lr=3e-3, warmup_steps=5, loss_chunk_size=256)
        trainer.fit(model, datamodule=data)
        val = trainer.validate(model, datamodule=data, verbose=False)[0]
        return {"train": losses.train, "val_loss": val["val/loss"]}
    finally:
        pipeline.keep_activations_in_compute_dtype = keep


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()
    info = machine_info()
    print(describe_machine(info))
    with tempfile.TemporaryDirectory() as tmp:
        demo = Path(tmp)
        make_demo_model(demo / "demo", steps=300)
        runs = {name: fine_tune(demo / "demo", args.steps, hooks) for name, hooks in ((SHIPPED, True), (BEFORE, False))}
    shipped, before = (torch.tensor(runs[k]["train"]) for k in (SHIPPED, BEFORE))
    difference = (shipped - before).abs()
    section(f"Demo model, {args.steps} optimizer steps, bf16-mixed, QLoRA nf4-dq r=8")
    rows = [[name, run["train"][0], run["train"][-1], run["val_loss"]] for name, run in runs.items()]
    print(markdown_table(["", "first train loss", "last train loss", "validation loss"], rows))
    print(
        f"\nPer-batch train loss, |shipped - before| over {len(difference)} micro-batches: mean"
        f" {float(difference.mean()):.4f}, max {float(difference.max()):.4f}; relative to the loss, mean"
        f" {float((difference / before.abs()).mean()):.2%}."
    )
    write_json("activation_dtype", {"steps": args.steps, "runs": runs})


if __name__ == "__main__":
    main()
