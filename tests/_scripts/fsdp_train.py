"""QLoRA on a tiny Llama with LowPrecisionFSDPStrategy, on 2 CPU processes (gloo) or on 1 with the same global batch.

Usage: python fsdp_train.py WORLD OUT_DIR PRECISION SCENARIO [DEVICE]
(WORLD: 1 | 2; PRECISION: 32-true | bf16-mixed | 16-mixed; SCENARIO: train | resume | pretrained | full | overflow |
options | bad;
DEVICE: cpu (gloo, default) | gpu (nccl) | gpu-offload (nccl, cpu_offload=True))

- train: 4 SGD steps (momentum, so the optimizer state matters), 2 per epoch, an adapter-only checkpoint after
  step 2; records the LoRA gradients of step 1, the final adapters, each rank's NF4 bytes, the sharded logits and
  those of an unsharded NF4 model with the same adapters, merged_state_dict and an exported adapter.
- resume: resumes OUT_DIR/../train/step=2.ckpt to step 4.
- pretrained: the same run, but the module is built on the meta device and filled from a saved checkpoint of
  the same base (pretrained=), each layer stored as NF4 as it loads and only the rank's rows kept (the live NF4
  bytes are recorded as it loads); then a plain-torch module built on meta without weights, initialized module by
  module (reset_parameters), beside the same module built whole.
- options: qat=, fp8= (emulated), activation_offloading=, optimizer='torchao_adamw8bit' and bf16-true, each
  beside its unsharded reference (a hand-written loop on the same global batch, from the same adapters).
- full: LoRA on an unquantized base with full (gathered) checkpoints: 4 steps, then a resume from step 2.
- overflow: 16-mixed; after the backward of step 2, rank 1 (only) writes inf into its shard of one gradient.
- bad: one Trainer per bad input; records each error message.
- pretrained_bin: pretrained from the same base saved as pytorch_model.bin; records the adapters.
- biases: pretrained's streamed load of a base with attention biases, LoRA bias='lora_only'; records the
  trainable parameters' local dtypes and the trained biases.
- compiled: train's first step with compile=True and checkpointed blocks (compiled after fully_shard); records
  the LoRA gradients of step 1 and whether each block was compiled.
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
from lightning.pytorch.plugins.precision import HalfPrecision, Precision
from torch.utils.data import DataLoader, DistributedSampler

from pl_lowprec import AMPPrecision, LowPrecisionFSDPStrategy
from pl_lowprec.adapters import export_adapter, merged_state_dict, trainable_state_dict
from pl_lowprec.demo import TinyLlama
from pl_lowprec.distributed.mesh import full_tensor
from pl_lowprec.loading import empty_weights
from pl_lowprec.transforms.config import TransformConfig
from pl_lowprec.transforms.dtypes import dtype_of_precision
from pl_lowprec.transforms.fp8 import FP8Config
from pl_lowprec.transforms.frozen_dtype import cast_frozen_weights
from pl_lowprec.transforms.lora import inject_lora
from pl_lowprec.transforms.nf4 import NF4Layout, dequantize_nf4, is_nf4, local, nf4_bytes, quantize_model_nf4
from pl_lowprec.transforms.pipeline import ModelTransform
from pl_lowprec.transforms.qat import QATConfig
from pl_lowprec.transforms.quantization import QuantizationConfig

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
        precision=precision if precision in ("32-true", "bf16-true") else None,
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


def _unsharded_logits(adapters: dict[str, torch.Tensor], ids: torch.Tensor, precision: str) -> torch.Tensor:
    """The same NF4 weights and adapters in one process, without FSDP; under mixed precision the frozen embedding
    and head in the compute dtype, as the strategy keeps them (``frozen_dtype.cast_frozen_weights``)."""
    model = TinyLlama(**SIZES)
    quantize_model_nf4(model, QuantizationConfig("nf4"), NF4Layout(scaler_block_size=32), torch.device("cpu"))
    inject_lora(model, LORA)
    model.load_state_dict(adapters, strict=False)
    if precision.endswith("-mixed"):
        cast_frozen_weights(model, dtype_of_precision(precision))
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
    ids = ids.to(trainer.strategy.root_device)  # FSDP leaves the model on the GPU after fit
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
        "unsharded_logits": _unsharded_logits(adapters, ids, precision),
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


def _saved(base: torch.nn.Module, out: str) -> Path:
    """``base`` written with ``save_pretrained`` where every rank reads it."""
    rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.distributed.is_initialized():  # an earlier scenario started it: save_pretrained writes on rank 0 only
        directory = Path(out) / "base"
        if rank == 0:
            base.save_pretrained(directory)
        torch.distributed.barrier()
    else:
        directory = Path(out) / f"base{rank}"
        base.save_pretrained(directory)
    return directory


def pretrained(world, out, precision) -> dict:
    directory = _saved(TinyLlama(**SIZES).model, out)  # the base every other run starts from (init_seed=0)
    strategy = _nf4_from(directory)
    held = _track_nf4_held(strategy.sharding)
    model = _fit_from_meta(strategy, world, out, precision)
    weights = [p for p in model.parameters() if not p.requires_grad]
    return {
        "adapters": _adapters(model),
        "nf4_bytes": sum(nf4_bytes(p) for p in weights),
        "nf4_held_during_load": held,
        "largest_nf4_layer": max(nf4_bytes(p) * world for p in weights),
        "initialized": initialized(world, out, precision),  # the same launch: one process group start less
    }


def pretrained_bin(world, out, precision) -> dict:
    """pretrained, from the same base saved as ``pytorch_model.bin`` (as older hub checkpoints are): each rank maps
    the file with torch.load(mmap=True) and keeps its rows."""
    directory = _saved(TinyLlama(**SIZES).model, out)
    rank = int(os.environ.get("LOCAL_RANK", 0))
    if rank == 0 or not torch.distributed.is_initialized():
        from safetensors.torch import load_file

        torch.save(load_file(directory / "model.safetensors"), directory / "pytorch_model.bin")
        (directory / "model.safetensors").unlink()
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    model = _fit_from_meta(_nf4_from(directory), world, out, precision)
    return {"adapters": _adapters(model), "read": sorted(p.name for p in directory.iterdir())}


def _nf4_from(directory: Path) -> LowPrecisionFSDPStrategy:
    """QLoRA nf4 with LoRA, sharded by decoder layer, streamed in from the checkpoint in ``directory``."""
    return LowPrecisionFSDPStrategy(
        quantization="nf4",
        lora=LORA,
        shard_modules="LlamaDecoderLayer",
        nf4_scaler_block_size=32,
        pretrained=directory,
        pretrained_prefix="model.",
    )


def _fit_from_meta(strategy: LowPrecisionFSDPStrategy, world, out, precision) -> pl.LightningModule:
    """The module built on the meta device (the strategy fills it from its checkpoint), then fitted."""
    trainer = _trainer(world, out, precision, strategy=strategy)
    with trainer.init_module(empty_init=True):
        model = SGDTinyLlama(**SIZES)
    assert all(p.device.type == "meta" for p in model.parameters())
    torch.manual_seed(0)
    trainer.fit(model, _loader(world))
    return model


class BiasedLlama(SGDTinyLlama):
    """SGDTinyLlama with biases on its attention projections (as Qwen2's q/k/v), built from seed 0 in bf16, as
    ``from_config`` builds a bf16 checkpoint's model."""

    def __init__(self) -> None:
        super().__init__(**SIZES)
        from transformers import LlamaForCausalLM

        self.model.config.attention_bias = True
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.model = LlamaForCausalLM(self.model.config).to(torch.bfloat16)


def biases(world, out, precision) -> dict:
    """``bias='lora_only'`` on a base with attention biases, streamed in (each rank keeps its rows): the biases
    train beside the adapters, in their dtype."""
    directory = _saved(BiasedLlama().model, out)
    strategy = LowPrecisionFSDPStrategy(
        quantization="nf4",
        lora={**LORA, "bias": "lora_only"},
        shard_modules="LlamaDecoderLayer",
        nf4_scaler_block_size=32,
        pretrained=directory,
        pretrained_prefix="model.",
    )
    trainer = _trainer(world, out, precision, strategy=strategy)
    with trainer.init_module(empty_init=True):
        model = BiasedLlama()
    torch.manual_seed(0)
    trainer.fit(model, _loader(world))
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    local = {str(p.to_local().dtype if hasattr(p, "to_local") else p.dtype) for p in trainable.values()}
    from safetensors.torch import load_file

    original = load_file(directory / "model.safetensors")
    trained = {n: full_tensor(p.detach()).cpu() for n, p in trainable.items() if n.endswith(".bias")}
    file_keys = {n: n.removeprefix("model.").replace(".base_layer", "") for n in trained}
    least_moved = min((t - original[file_keys[n]]).abs().max() for n, t in trained.items())
    return {"local_dtypes": local, "biases": trained, "least_moved": least_moved}


class PlainBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(64)
        self.up, self.down = torch.nn.Linear(64, 128), torch.nn.Linear(128, 64)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class PlainLM(pl.LightningModule):
    """Plain torch modules, each with ``reset_parameters``: initialized module by module when built on meta."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Embedding(256, 64), PlainBlock(), PlainBlock(), torch.nn.Linear(64, 256)
        )

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        logits = self.net(ids[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 256), ids[:, 1:].reshape(-1))

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.5)


class InitialWeights(Callback):
    def on_train_start(self, trainer, module):
        self.weights = _full_weights(module)


def _full_weights(module) -> dict[str, torch.Tensor]:
    return {
        n: (dequantize_nf4(p) if is_nf4(p) else full_tensor(p)).detach().clone() for n, p in module.named_parameters()
    }


def initialized(world, out, precision) -> dict:
    """A module built on the meta device without pretrained weights: initialized and quantized module by module,
    each rank keeping its rows; compared with the same module built whole and quantized in one process."""
    with empty_weights():
        model = PlainLM()
    strategy = LowPrecisionFSDPStrategy(
        quantization="nf4", lora=LORA, shard_modules="PlainBlock", nf4_scaler_block_size=32
    )
    held, initial = _track_nf4_held(strategy.sharding), InitialWeights()
    torch.manual_seed(0)
    _trainer(world, out, precision, strategy=strategy, callbacks=[initial], steps=1).fit(model, _loader(world))
    torch.manual_seed(0)
    reference = PlainLM()  # reset_parameters in the same module order, from the same seed
    quantize_model_nf4(reference, QuantizationConfig("nf4"), NF4Layout(scaler_block_size=32), torch.device("cpu"))
    inject_lora(reference, LORA)
    weights = [p for p in model.parameters() if not p.requires_grad]
    return {
        "initial": initial.weights,
        "reference": _full_weights(reference),
        "nf4_bytes": sum(nf4_bytes(p) for p in weights),
        "nf4_held_during_load": held,
        "whole_nf4_bytes": sum(nf4_bytes(p) for p in reference.parameters()),
        "largest_nf4_layer": max(nf4_bytes(p) for p in reference.parameters()),
    }


def _live_nf4_bytes() -> int:
    """Bytes of every NF4 tensor alive in this process (each storage once): what the rank holds, leaks included."""
    import gc

    storages = {}
    for obj in gc.get_objects():
        if type(obj).__name__ == "NF4Tensor":
            for inner in (obj.quantized_data, obj.quantized_scalers, obj.quantization_factor, obj.scaler_mean):
                storage = inner.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _track_nf4_held(sharding) -> list[int]:
    """The live NF4 bytes each time the loader hands a parameter over to be kept (before and after): the
    largest is the rank's peak while the model is filled."""
    held, before = [], _live_nf4_bytes()  # NF4 of an earlier run in this process, not this rank's load
    placement = sharding.placement

    def tracked():
        keep = placement()

        def keep_and_count(param):
            held.append(_live_nf4_bytes() - before)
            kept = keep(param) if keep is not None else param
            held.append(_live_nf4_bytes() - before)
            return kept

        return keep_and_count

    sharding.placement = tracked
    return held


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


class AdamWTinyLlama(TinyLlama):
    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


# 8-bit optimizer state only for tensors of 4096+ elements, decided on each rank's shard: r=128 on down_proj makes
# every adapter's shard 4096+ elements (A: 128x128, B: 64x128), so sharded and unsharded states are both 8-bit.
LORA_8BIT = {"r": 128, "lora_alpha": 16, "target_modules": ["down_proj"]}
NF4 = {"quantization": "nf4", "nf4_scaler_block_size": 32}
OPTION_CASES = {  # strategy arguments, module, LoRA, precision
    "qat": ({"qat": QATConfig("int8-dynamic-int4-weight", convert_on_fit_end=False)}, SGDTinyLlama, LORA, "32-true"),
    "fp8": ({"fp8": FP8Config(emulate=True)}, SGDTinyLlama, LORA, "32-true"),
    "offloading": ({"activation_offloading": True}, SGDTinyLlama, LORA, "32-true"),
    "torchao_adamw8bit": ({"optimizer": "torchao_adamw8bit"}, AdamWTinyLlama, LORA_8BIT, "32-true"),
    "bf16-true": (NF4, SGDTinyLlama, LORA, "bf16-true"),
}


class InitialAdapters(Callback):
    def on_train_start(self, trainer, module):
        self.adapters = _adapters(module)


def _unsharded_run(args: dict, module_class, lora: dict, precision: str, initial: dict, world: int) -> dict[str, dict]:
    """The reference: the same transform without sharding (NF4 as FSDP stores it), from the same initial adapters,
    in one process, with a hand-written loop that accumulates each global batch in the ranks' parts (float8 scales
    activations per part)."""
    model = module_class(**SIZES)
    args = dict(args)
    if args.pop("quantization", None):
        layout = NF4Layout(scaler_block_size=args.pop("nf4_scaler_block_size"))
        quantize_model_nf4(model, QuantizationConfig("nf4"), layout, torch.device("cpu"))
    plugin = HalfPrecision(precision) if precision == "bf16-true" else Precision()
    transform = ModelTransform(TransformConfig(lora=lora, **args))
    transform.apply(model, plugin, torch.device("cpu"))
    model.load_state_dict(initial, strict=False)
    model = plugin.convert_module(model)
    (optimizer,) = transform.swap_optimizers([model.configure_optimizers()], [], torch.device("cpu"))
    grads = None
    for batch in [*_loader(1), *_loader(1)]:  # the Trainer's 4 steps: 2 epochs of 2
        for ids in (batch["input_ids"][rank::world] for rank in range(world)):  # as DistributedSampler splits it
            with transform.offloading(model, torch.device("cpu")), plugin.forward_context():
                (model.model(input_ids=ids, labels=ids, use_cache=False).loss / world).backward()
        grads = grads or {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        optimizer.step()
        optimizer.zero_grad()
    return {"grads": grads, "adapters": {k: v.detach().clone() for k, v in trainable_state_dict(model).items()}}


def options(world, out, precision) -> dict:
    """qat=, fp8= (emulated), activation_offloading= (the CPU refusal patched out: the hooks run the same) and
    optimizer='torchao_adamw8bit' under FSDP, each beside its unsharded reference."""
    from pl_lowprec.transforms import pipeline as transform_module
    from pl_lowprec.transforms.offloading import OffloadActivations

    transform_module.check_offload_device = lambda device: None
    to_host, offloaded = OffloadActivations._to_host, []

    def counted(self, tensor):
        offloaded.append(tensor.numel() * tensor.element_size())
        return to_host(self, tensor)

    OffloadActivations._to_host = counted
    results = {}
    for name, (args, module_class, lora, case_precision) in OPTION_CASES.items():
        strategy = LowPrecisionFSDPStrategy(lora=lora, shard_modules="LlamaDecoderLayer", **args)
        model, initial, record = module_class(**SIZES), InitialAdapters(), Record()
        trainer = _trainer(world, out, case_precision, strategy=strategy, callbacks=[initial, record])
        offloaded.clear()
        trainer.fit(model, _loader(world))
        optimizer = trainer.optimizers[0]
        states = [local(s) for state in optimizer.state.values() for k, s in state.items() if k == "exp_avg"]
        results[name] = {
            "sharded": {"grads": record.grads, "adapters": _adapters(model)},
            "offloaded_bytes": sum(offloaded),
            "precision": trainer.precision,
            "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "unsharded": _unsharded_run(args, module_class, lora, case_precision, initial.adapters, world),
            "plain": _unsharded_run({}, module_class, lora, "32-true", initial.adapters, world),  # without the option
            "optimizer": type(optimizer).__name__,
            "state_types": sorted({type(s).__name__ for s in states}),
            "layers": sorted({type(m).__name__ for m in model.modules()}),
        }
    return results


def _scale_state(trainer) -> dict | None:
    plugin = trainer.precision_plugin
    if not isinstance(plugin, AMPPrecision):
        return None
    return dataclasses.asdict(plugin.loss_scale_state())


def bad(world, out, precision) -> dict:
    cases = {
        "unknown_unit": {"shard_modules": "DecoderBlock"},
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
    strategy = LowPrecisionFSDPStrategy(lora={**LORA, "init_lora_weights": "olora"}, shard_modules="LlamaDecoderLayer")
    try:  # OLoRA's QR of each whole weight, on a rank's rows
        _trainer(world, out, precision, strategy=strategy).fit(SGDTinyLlama(**SIZES), _loader(world))
        errors["whole_weight_init"] = None
    except ValueError as err:
        errors["whole_weight_init"] = str(err)
    with empty_weights():  # on meta, no pretrained=: LlamaRMSNorm has no reset_parameters to initialize it
        model = SGDTinyLlama(**SIZES)
    strategy = LowPrecisionFSDPStrategy(lora=LORA, shard_modules="LlamaDecoderLayer")
    try:
        _trainer(world, out, precision, strategy=strategy).fit(model, _loader(world))
        errors["no_reset"] = None
    except ValueError as err:
        errors["no_reset"] = str(err)
    return errors


def compiled(world, out, precision) -> dict:
    record = Record()
    torch.manual_seed(0)
    model = SGDTinyLlama(**SIZES)
    strategy = LowPrecisionFSDPStrategy(
        quantization="nf4",
        lora=LORA,
        activation_checkpointing="LlamaDecoderLayer",
        nf4_scaler_block_size=32,
        compile=True,
        process_group_backend="gloo" if DEVICE == "cpu" else "nccl",
    )
    _trainer(world, out, precision, strategy=strategy, callbacks=[record], steps=1).fit(model, _loader(world))
    layers = model.model.model.layers
    return {"grads": record.grads, "compiled": [layer._compiled_call_impl is not None for layer in layers]}


def main(world: str, out: str, precision: str, scenario_names: str) -> None:
    """Run each comma-separated scenario in turn in the same processes (one launch, one import of everything);
    each writes ``OUT/<scenario>/rank<r>.pt``."""
    warnings.filterwarnings("ignore")
    world_size = int(world)
    scenarios = {
        "train": train,
        "resume": resume,
        "pretrained": pretrained,
        "pretrained_bin": pretrained_bin,
        "full": full,
        "overflow": overflow,
        "options": options,
        "bad": bad,
        "compiled": compiled,
        "biases": biases,
    }
    rank = int(os.environ.get("LOCAL_RANK", 0))
    for name in scenario_names.split(","):
        folder = Path(out) / name
        folder.mkdir(parents=True, exist_ok=True)
        result = scenarios[name](world_size, str(folder), precision)
        torch.save(result, folder / f"rank{rank}.pt")


if __name__ == "__main__":
    main(*sys.argv[1:5])
