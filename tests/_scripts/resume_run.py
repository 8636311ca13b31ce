"""Train LoRA adapters on a tiny Llama, uninterrupted, killed with SIGKILL mid-epoch, or resumed from last.ckpt.

Usage: python resume_run.py {full|killed|resumed} OUT_DIR SPEC
(SPEC: stdlib, or JSON {"pretrained": DIR, "data": TextDataModule arguments}: CausalLM, accumulating 2)
- full: MAX_STEPS steps; writes OUT_DIR/adapters.pt.
- killed: the same run, killed with SIGKILL at step KILL_AT (checkpoints every EVERY steps, save_last=True).
- resumed: `fit(ckpt_path=OUT_DIR/ckpts/last.ckpt)` to MAX_STEPS; writes OUT_DIR/adapters.pt.
Run by tests/data/test_exact_resume.py.
"""

import json
import os
import signal
import sys
import warnings

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from pl_lowprec import LowPrecisionStrategy
from pl_lowprec.adapters import trainable_state_dict
from pl_lowprec.demo import StdlibTextDataModule, TinyLlama

MAX_STEPS, EVERY, KILL_AT = 26, 5, 18


class KillAt(pl.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)


def model_and_data(spec: str) -> tuple[pl.LightningModule, pl.LightningDataModule, int, float]:
    """TinyLlama on StdlibTextDataModule, or CausalLM on TextDataModule (a JSON spec) accumulating 2 batches; the
    LoRA dropout (the spec's ``lora_dropout``, else 0)."""
    if spec == "stdlib":  # 41 training windows of 32 bytes: 11 batches per epoch, so the run spans 3 epochs
        model = TinyLlama(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, max_len=64, warmup_steps=3)
        return model, StdlibTextDataModule(seq_len=32, batch_size=4, max_bytes=1400), 1, 0.0
    from pl_lowprec.data import TextDataModule
    from pl_lowprec.models import CausalLM

    spec = json.loads(spec)
    model = CausalLM(spec["pretrained"], lr=1e-2, warmup_steps=3)
    return model, TextDataModule(**spec["data"]), 2, spec.get("lora_dropout", 0.0)


def main(mode: str, out: str, spec: str) -> None:
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model, data, accumulate, lora_dropout = model_and_data(spec)
    callbacks = [ModelCheckpoint(dirpath=f"{out}/ckpts", every_n_train_steps=EVERY, save_last=True)]
    if mode == "killed":
        callbacks.append(KillAt())
    trainer = pl.Trainer(
        accelerator="cpu",
        strategy=LowPrecisionStrategy(lora={"r": 4, "lora_alpha": 8, "lora_dropout": lora_dropout}),
        max_steps=MAX_STEPS,
        accumulate_grad_batches=accumulate,
        callbacks=callbacks,
        limit_val_batches=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    ckpt = f"{out}/ckpts/last.ckpt" if mode == "resumed" else None
    trainer.fit(model, datamodule=data, ckpt_path=ckpt)
    torch.save(trainable_state_dict(model), f"{out}/adapters.pt")


if __name__ == "__main__":
    main(*sys.argv[1:4])
