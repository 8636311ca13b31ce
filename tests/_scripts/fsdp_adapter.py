"""pretrained_adapter= under LowPrecisionFSDPStrategy on 2 CPU processes (gloo): one step from the saved adapter.

Usage: python fsdp_adapter.py BASE_DIR ADAPTER_DIR OUT_DIR
Each rank builds the module on the meta device, fills its rows from BASE_DIR (pretrained=), continues ADAPTER_DIR
and writes OUT_DIR/rank{N}.pt with the first step's loss (the adapter as saved, before any update), the same batch
on every rank. Run by tests/transforms/test_pretrained_adapter.py; Lightning's launcher re-runs it for rank 1.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1]))
from lightning_helpers import quiet_trainer
from loading_helpers import LlamaModule
from qlora_helpers import LossRecorder, ids_loader

from pl_lowprec import LowPrecisionFSDPStrategy

base, adapter, out = (Path(arg) for arg in sys.argv[1:4])
recorder = LossRecorder()
strategy = LowPrecisionFSDPStrategy(pretrained=base, pretrained_adapter=adapter)
trainer = quiet_trainer(strategy=strategy, devices=2, max_steps=1, callbacks=[recorder], use_distributed_sampler=False)
with trainer.init_module(empty_init=True):
    module = LlamaModule()
trainer.fit(module, ids_loader(batches=1))
out.mkdir(parents=True, exist_ok=True)
torch.save({"losses": recorder.losses}, out / f"rank{trainer.global_rank}.pt")
