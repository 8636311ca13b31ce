"""The user's path for ``CausalLM`` + ``TextDataModule``: ``pl-lowprec fit --config configs/finetune-causal-lm.yaml``
plus overrides, on one process or on 2 CPU ranks, then ``pl-lowprec export`` and ``pl-lowprec generate``.

Usage: python causal_lm_cli.py ROOT STEP[,STEP...]   (ROOT/spec.json: {"pretrained", "train", "val"})

Each STEP is one ``pl-lowprec fit`` run by the console script's ``main`` in this process, in turn (one launch,
several scenarios; Lightning's launcher re-runs this script for rank 1, which runs the same steps):
- ``RUN``: an uninterrupted fit in ROOT/RUN (RUN: lowprec, fsdp_one, lightning on 1 process; ddp, fsdp,
  fsdp_auto, lightning_fsdp on 2);
- ``RUN.killed``: the same fit in ROOT/RUN.resume, SIGKILLed at step KILL_AT, after the checkpoint at CKPT_EVERY;
- ``RUN.resumed``: ``--ckpt_path last`` in ROOT/RUN.resume, to the end.
Every fit records its losses, first gradients and final adapters in ROOT/<dir>/record.pt, a killed one in
ROOT/<dir>/killed.pt (``causal_lm_callbacks.RecordLoss``). Run by tests/models/test_causal_lm_multi_device.py.
"""

import json
import sys
import warnings
from pathlib import Path

import yaml

from pl_lowprec.cli import main

CONFIG = str(Path(__file__).parents[2] / "configs" / "finetune-causal-lm.yaml")
MAX_STEPS, CKPT_EVERY, KILL_AT = 4, 2, 3
LORA = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": "all-linear"}
SHIPPED = {"quantization": "nf4-dq", "lora": LORA, "activation_checkpointing": ["LlamaDecoderLayer"]}
# name: (strategy class, init_args, devices); FSDP's NF4 scale groups of 32 fit every layer on 1 and on 2 ranks, so
# fsdp and fsdp_one store the same 4-bit weights; fsdp_auto keeps the default (nf4_scaler_block_size="auto").
RUNS = {
    "lowprec": ("pl_lowprec.LowPrecisionStrategy", SHIPPED, 1),
    "ddp": ("pl_lowprec.LowPrecisionDDPStrategy", SHIPPED, 2),
    "fsdp": ("pl_lowprec.LowPrecisionFSDPStrategy", {**SHIPPED, "nf4_scaler_block_size": 32}, 2),
    "fsdp_one": ("pl_lowprec.LowPrecisionFSDPStrategy", {**SHIPPED, "nf4_scaler_block_size": 32}, 1),
    "fsdp_auto": ("pl_lowprec.LowPrecisionFSDPStrategy", SHIPPED, 2),
    # Lightning's own strategies, full fine-tuning (no quantization, no LoRA): CausalLM loads and shards itself
    "lightning": ("auto", None, 1),
    "lightning_fsdp": (
        "lightning.pytorch.strategies.ModelParallelStrategy",
        {"data_parallel_size": 2, "tensor_parallel_size": 1},
        2,
    ),
}
GLOBAL_BATCH = 4


def overrides(root: Path, spec: dict, run: str, directory: str, kill: bool) -> str:
    """The second ``--config``: what this test changes in the shipped config, as a user would."""
    strategy, init_args, devices = RUNS[run]
    out = root / directory
    callbacks = [
        {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {"every_n_train_steps": CKPT_EVERY, "save_last": True},
        },
        {
            "class_path": "causal_lm_callbacks.RecordLoss",
            "init_args": {"out": str(out / ("killed.pt" if kill else "record.pt"))},
        },
    ]
    if kill:
        callbacks.append({"class_path": "causal_lm_callbacks.KillAt", "init_args": {"step": KILL_AT}})
    config = {
        "trainer": {
            "accelerator": "cpu",
            "devices": devices,
            "precision": "32-true",
            "plugins": [],
            "max_steps": MAX_STEPS,
            "val_check_interval": 4,  # micro-batches: after steps 2 and 4 (fsdp_auto only: the loss falls)
            "limit_val_batches": 1 if run == "fsdp_auto" else 0,
            "num_sanity_val_steps": 0,
            "log_every_n_steps": 1,
            "enable_progress_bar": False,
            "enable_model_summary": False,
            "strategy": strategy if init_args is None else {"class_path": strategy, "init_args": init_args},
            "callbacks": callbacks,
            # a fixed version: the resumed run finds the killed run's last.ckpt under it (--ckpt_path last)
            "logger": {
                "class_path": "lightning.pytorch.loggers.CSVLogger",
                "init_args": {"save_dir": str(out), "name": "run", "version": 0},
            },
        },
        "model": {
            "init_args": {"pretrained": spec["pretrained"], "lr": 0.01, "warmup_steps": 1, "loss_chunk_size": 16}
        },
        "data": {
            "init_args": {
                "train_files": spec["train"],
                "val_files": spec["val"],
                "tokenizer": spec["pretrained"],
                "seq_len": 48,
                "batch_size": GLOBAL_BATCH // devices,
            }
        },
    }
    return yaml.safe_dump(config)


def run_step(root: Path, spec: dict, step: str) -> None:
    run, _, mode = step.partition(".")
    directory = f"{run}.resume" if mode else run
    (root / directory).mkdir(parents=True, exist_ok=True)
    args = ["fit", f"--config={CONFIG}", f"--config={overrides(root, spec, run, directory, mode == 'killed')}"]
    main([*args, "--ckpt_path=last"] if mode == "resumed" else args)


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    root = Path(sys.argv[1])
    spec = json.loads((root / "spec.json").read_text())
    for step in sys.argv[2].split(","):
        run_step(root, spec, step)
