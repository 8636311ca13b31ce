"""QLoRA on a tiny Llama with LowPrecisionFSDPStrategy, on 2 CPU processes (gloo) or on 1 with the same global batch.

Usage: python fsdp_train.py WORLD OUT_DIR PRECISION SCENARIO [DEVICE]
(WORLD: 1 | 2; PRECISION: 32-true | bf16-mixed | 16-mixed; SCENARIO: train | resume | overflow | bad;
DEVICE: cpu (gloo, default) | gpu (nccl) | gpu-offload (nccl, cpu_offload=True))

- train: 4 SGD steps (momentum, so the optimizer state matters), 2 per epoch, an adapter-only checkpoint after
  step 2; records the LoRA gradients of step 1, the final adapters, each rank's NF4 bytes, the sharded logits and
  those of an unsharded NF4 model with the same adapters, merged_state_dict and an exported adapter.
- resume: resumes OUT_DIR/../train/step=2.ckpt to step 4.
- pretrained: the same run, but the module is built on the meta device and filled from a saved checkpoint of
  the same base (pretrained=), each layer stored as NF4 as it loads.
- full: LoRA on an unquantized base with full (gathered) checkpoints: 4 steps, then a resume from step 2.
- overflow: 16-mixed; after the backward of step 2, rank 1 (only) writes inf into its shard of one gradient.
- bad: one Trainer per bad input; records each error message.
Writes OUT_DIR/rank{N}.pt. Run by tests/strategies/test_fsdp.py; Lightning's launcher re-runs it for rank 1.
"""

import dataclasses
import os
import sys
import warnings
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader, DistributedSampler

from pl_lowprec import AMPPrecision, LowPrecisionFSDPStrategy
from pl_lowprec.adapters import export_adapter, merged_state_dict, trainable_state_dict
from pl_lowprec.demo import TinyLlama
from pl_lowprec.loading import empty_weights
from pl_lowprec.lora import inject_lora
from pl_lowprec.nf4 import NF4Layout, local, nf4_bytes, quantize_model_nf4
from pl_lowprec.quantization import QuantizationConfig
from pl_lowprec.sharding import full_tensor

GLOBAL_BATCH, STEPS_PER_EPOCH = 4, 2
DEVICE = sys.argv[5] if len(sys.argv) > 5 else "cpu"
LORA = {"r": 8, "lora_alpha": 16}
SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_layers": 2, "num_heads": 4, "max_len": 32}


class SGDTinyLlama(TinyLlama):
    """SGD, not Adam: Adam hides a gradient summed instead of averaged across ranks (pytorch #162338)."""

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.5, momentum=0.9)


class Record(Callback):
    """Gathers what the test compares; every rank takes part in each gather."""

    def __init__(self, inject_overflow: bool = False) -> None:
        self.grads, self.before_skip, self.after_skip, self.inject_overflow = {}, None, None, inject_overflow

    def on_after_backward(self, trainer, module):
        if self.inject_overflow and trainer.global_step == 1:
            self.before_skip = _adapters(module)
            if trainer.global_rank == 1:  # one rank's shard only: the scaler must agree across ranks
                grad = next(p.grad for n, p in module.named_parameters() if "lora_B" in n)
                local(grad).view(-1)[0] = float("inf")

    def on_before_optimizer_step(self, trainer, module, optimizer):
        if trainer.global_step == 0 and not self.grads:
            self.grads = {n: full_tensor(p.grad).clone() for n, p in module.named_parameters() if p.requires_grad}

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        if self.inject_overflow and trainer.global_step == 2 and self.after_skip is None:
            self.after_skip = _adapters(module)


def _adapters(module) -> dict[str, torch.Tensor]:
    return {k: full_tensor(v).clone() for k, v in trainable_state_dict(module).items()}


def _loader(world: int) -> DataLoader:
    ids = torch.randint(0, 256, (GLOBAL_BATCH * STEPS_PER_EPOCH, 17), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row} for row in ids]
    rank = int(os.environ.get("LOCAL_RANK", 0))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False) if world > 1 else None
    return DataLoader(data, batch_size=GLOBAL_BATCH // world, sampler=sampler)


def _trainer(world, out, precision, strategy=None, callbacks=(), steps=2 * STEPS_PER_EPOCH) -> pl.Trainer:
    strategy = strategy or LowPrecisionFSDPStrategy(
        quantization="nf4",
        lora=LORA,
        shard_modules="LlamaDecoderLayer",
        nf4_scaler_block_size=32,
        cpu_offload=DEVICE == "gpu-offload",
        process_group_backend="gloo" if DEVICE == "cpu" else "nccl",
    )
    return pl.Trainer(
        accelerator="cpu" if DEVICE == "cpu" else "gpu",
        devices=world,
        strategy=strategy,
        precision="32-true" if precision in ("32-true", "bf16-true") else None,
        plugins=[AMPPrecision(precision)] if precision.endswith("-mixed") else [],
        max_steps=steps,
        use_distributed_sampler=False,
        default_root_dir=out,
        logger=False,
        callbacks=list(callbacks),
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )


def _unsharded_logits(adapters: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """The same NF4 weights and adapters in one process, without FSDP."""
    model = TinyLlama(**SIZES)
    quantize_model_nf4(model, QuantizationConfig("nf4"), NF4Layout(scaler_block_size=32), torch.device("cpu"))
    inject_lora(model, LORA)
    model.load_state_dict(adapters, strict=False)
    with torch.no_grad():
        return model.to(ids.device)(ids)


def train(world, out, precision) -> dict:
    record = Record()
    ckpt = ModelCheckpoint(dirpath=out, filename="{step}", every_n_train_steps=2, save_top_k=-1)
    torch.manual_seed(0)
    model = SGDTinyLlama(**SIZES)
    trainer = _trainer(world, out, precision, callbacks=[record, ckpt])
    trainer.fit(model, _loader(world))
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        sharded = model(ids)
    adapters = _adapters(model)
    weights = [p for p in model.parameters() if not p.requires_grad]
    export = export_adapter(model, Path(out) / f"adapter{trainer.global_rank}")
    return {
        "grads": record.grads,
        "adapters": adapters,
        "nf4_bytes": sum(nf4_bytes(p) for p in weights),
        "sharded_logits": sharded,
        "unsharded_logits": _unsharded_logits(adapters, ids),
        "merged": merged_state_dict(model),
        "export": str(export),
        "loss_scale": _scale_state(trainer),
    }


def resume(world, out, precision) -> dict:
    torch.manual_seed(0)
    model = SGDTinyLlama(**SIZES)
    trainer = _trainer(world, out, precision)
    trainer.fit(model, _loader(world), ckpt_path=str(Path(out).parent / "train" / "step=2.ckpt"))
    return {"adapters": _adapters(model)}


def pretrained(world, out, precision) -> dict:
    directory = Path(out) / f"base{os.environ.get('LOCAL_RANK', 0)}"
    TinyLlama(**SIZES).model.save_pretrained(directory)  # the base every other run starts from (init_seed=0)
    with empty_weights():
        model = SGDTinyLlama(**SIZES)
    assert all(p.device.type == "meta" for p in model.parameters())
    strategy = LowPrecisionFSDPStrategy(
        quantization="nf4",
        lora=LORA,
        shard_modules="LlamaDecoderLayer",
        nf4_scaler_block_size=32,
        pretrained=directory,
        pretrained_prefix="model.",
    )
    torch.manual_seed(0)
    _trainer(world, out, precision, strategy=strategy).fit(model, _loader(world))
    return {"adapters": _adapters(model)}


def full(world, out, precision) -> dict:
    def strategy():
        return LowPrecisionFSDPStrategy(lora=LORA, shard_modules="LlamaDecoderLayer", adapter_only_checkpoint=False)

    ckpt = ModelCheckpoint(dirpath=out, filename="{step}", every_n_train_steps=2, save_top_k=-1)
    torch.manual_seed(0)
    uninterrupted = SGDTinyLlama(**SIZES)
    _trainer(world, out, precision, strategy=strategy(), callbacks=[ckpt]).fit(uninterrupted, _loader(world))
    resumed = SGDTinyLlama(**SIZES)
    trainer = _trainer(world, out, precision, strategy=strategy())
    trainer.fit(resumed, _loader(world), ckpt_path=str(Path(out) / "step=2.ckpt"))
    saved = torch.load(Path(out) / "step=2.ckpt", weights_only=False)["state_dict"]
    return {"uninterrupted": _adapters(uninterrupted), "resumed": _adapters(resumed), "saved_keys": sorted(saved)}


def overflow(world, out, precision) -> dict:
    record = Record(inject_overflow=True)
    torch.manual_seed(0)
    model = SGDTinyLlama(**SIZES)
    trainer = _trainer(world, out, "16-mixed", callbacks=[record], steps=3)
    trainer.fit(model, _loader(world))
    return {"before": record.before_skip, "after": record.after_skip, "loss_scale": _scale_state(trainer)}


def _scale_state(trainer) -> dict | None:
    plugin = trainer.precision_plugin
    if not isinstance(plugin, AMPPrecision):
        return None
    return dataclasses.asdict(plugin.loss_scale_state())


def bad(world, out, precision) -> dict:
    cases = {
        "unknown_unit": {"shard_modules": "DecoderBlock"},
        "no_unit": {"shard_modules": None},
        "block_split": {"shard_modules": "LlamaDecoderLayer", "nf4_scaler_block_size": 64},
        "cpu_offload": {"shard_modules": "LlamaDecoderLayer", "nf4_scaler_block_size": 32, "cpu_offload": True},
    }
    errors = {}
    for name, args in cases.items():
        strategy = LowPrecisionFSDPStrategy(quantization="nf4", lora=LORA, **args)
        model = SGDTinyLlama(**SIZES)
        try:
            _trainer(world, out, precision, strategy=strategy).fit(model, _loader(world))
            errors[name] = None
        except ValueError as err:
            errors[name] = str(err)
            errors[f"{name}_steps"] = model.trainer.global_step if model._trainer else 0
    return errors


def main(world: str, out: str, precision: str, scenario: str) -> None:
    warnings.filterwarnings("ignore")
    world_size = int(world)
    scenarios = {
        "train": train,
        "resume": resume,
        "pretrained": pretrained,
        "full": full,
        "overflow": overflow,
        "bad": bad,
    }
    result = scenarios[scenario](world_size, out, precision)
    rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.save(result, f"{out}/rank{rank}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:5])
