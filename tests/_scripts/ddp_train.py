"""Trains TinyGPT for a few steps, on 2 DDP CPU processes or on 1 with the same global batch.

Usage: python ddp_train.py {ddp|single} OUT_DIR PRECISION [gpt|qlora|qlora-compiled|qat] [cpu|gpu]
(PRECISION: 32-true | 16-mixed | bf16-mixed; cpu runs gloo, gpu runs nccl)
With "qlora", a tiny Llama is trained with nf4-dq base weights, LoRA adapters and checkpointed decoder layers;
"qlora-compiled" is the same with compile=True (each checkpointed decoder layer compiled);
with "qat", TinyGPT is trained with int8-dynamic-int4-weight QAT and converted at the end of fit.
Writes OUT_DIR/rank{N}.pt with the final parameters (and the loss-scale state under "_loss_scale", the predicted
step under "_step_time").
Run by tests/strategies/test_ddp.py; Lightning's DDP launcher re-runs this script for rank 1.
"""

import dataclasses
import os
import sys

import lightning.pytorch as pl
import torch
from torch.utils.data import DistributedSampler

from pl_lowprec import AMPPrecision, LowPrecisionDDPStrategy, LowPrecisionStrategy, MemoryTracker
from pl_lowprec.demo import TinyGPT, TinyLlama

GLOBAL_BATCH, STEPS = 8, 4


class SGDTinyLlama(TinyLlama):
    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.5)


class SGDTinyGPT(TinyGPT):
    """SGD, not Adam: Adam normalises gradient scale away and amplifies rounding noise in tiny gradients, so a
    wrongly summed (not averaged) DDP gradient would go unseen and exact comparisons would be noisy."""

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


def main(mode: str, out: str, precision: str, variant: str = "gpt", accelerator: str = "cpu") -> None:
    ids = torch.randint(0, 256, (GLOBAL_BATCH * STEPS, 33), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row} for row in ids]
    ddp = mode == "ddp"
    # Lightning's own DistributedSampler shuffles the training set; keep the order to compare with 1 process.
    rank = int(os.environ.get("LOCAL_RANK", 0))
    sampler = DistributedSampler(data, num_replicas=2, rank=rank, shuffle=False) if ddp else None
    loader = torch.utils.data.DataLoader(data, batch_size=GLOBAL_BATCH // 2 if ddp else GLOBAL_BATCH, sampler=sampler)
    block = "Block"
    transform = {}
    if variant.startswith("qlora"):
        block = "LlamaDecoderLayer"
        # memory_budget: the run predicts its step, collectives timed on its own process group (ranks > 1)
        transform = {"quantization": "nf4-dq", "lora": {"r": 8, "lora_alpha": 16}, "memory_budget": "8GiB"}
    if variant == "qlora-compiled":
        transform["compile"] = True
    if variant == "qat":
        transform = {"qat": "int8-dynamic-int4-weight"}
    if ddp:
        strategy = LowPrecisionDDPStrategy(
            activation_checkpointing=block,
            process_group_backend="nccl" if accelerator == "gpu" else "gloo",
            **transform,
        )
    else:
        strategy = LowPrecisionStrategy(activation_checkpointing=block, **transform)
    plugins = [] if precision == "32-true" else [AMPPrecision(precision)]
    torch.manual_seed(0)
    if variant.startswith("qlora"):
        model = SGDTinyLlama(hidden_size=64, intermediate_size=192, num_layers=2, num_heads=4, max_len=64)
    else:
        model = SGDTinyGPT(dim=32, layers=2, heads=2, max_len=64)
    tracker = MemoryTracker(print_summary=False)
    trainer = pl.Trainer(
        callbacks=[tracker],
        accelerator=accelerator,
        devices=2 if ddp else 1,
        strategy=strategy,
        plugins=plugins,
        max_steps=STEPS,
        use_distributed_sampler=False,
        default_root_dir=out,  # memory_summary.json goes there, not into the working directory
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader)
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state["_loss_scale"] = plugins[0].loss_scale_state() if plugins else None
    state["_memory"] = tracker.summary["fit"]
    blocks = model.model.model.layers if variant.startswith("qlora") else model.blocks
    state["_checkpointed"] = [type(b.__dict__.get("forward")).__name__ for b in blocks]
    state["_compiled"] = [b._compiled_call_impl is not None for b in blocks]
    predicted = strategy.prediction.step_time if strategy.prediction is not None else None
    state["_step_time"] = dataclasses.asdict(predicted) if predicted is not None else None
    torch.save(state, f"{out}/rank{trainer.global_rank}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:6])
