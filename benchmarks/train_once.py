"""One training run in a fresh process, so that its peak memory is its own; prints one ``RESULT {json}`` line.

python benchmarks/train_once.py --stack {lightning,causal-lm,hf} --mode {full,lora,qlora} [--checkpointing]
    [--steps N] [--hidden H] [--layers L] [--batch B] [--seq T] [--precision 32-true] [--pretrained DIR]

lightning: Trainer + LowPrecisionStrategy (+ AMPPrecision under a "-mixed" precision), + MemoryTracker with
``--breakdown`` (its per-stage peak reset is accounted for: the peak before the reset is read first).
causal-lm: ``pl_lowprec.models.CausalLM(pretrained=DIR)``, built on the meta device and streamed in (quantized as
it loads) by the same strategy; unquantized weights keep the compute dtype, loss in chunks of 256 positions.
hf: the Hugging Face recipe as its users write it: ``AutoModelForCausalLM.from_pretrained(DIR,
quantization_config=BitsAndBytesConfig(...))`` from a checkpoint written by ``save_pretrained``, peft's
``prepare_model_for_kbit_training`` and ``get_peft_model``, transformers' ``Trainer``.
Both see the same batches in the same order, the same base weights, LoRA config and seed, AdamW (lr 1e-3,
weight decay 0.01), clipping at 1.0 and a constant LR.

Memory is measured from a baseline taken after every library is imported and before the model is built:
CPU: peak resident set (VmHWM) minus the resident set at the baseline; CUDA: ``max_memory_allocated`` minus
the memory allocated at the baseline. ``after_load`` is the memory held once the model is ready to train
(quantized base, adapters, before the first step) and ``load_peak`` the peak up to then, both above the baseline.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import bitsandbytes  # noqa: F401  (every library is imported before the memory baseline, on both stacks)
import hf_trainer
import lightning.pytorch as pl
import peft
import torch
import yaml
from hf_trainer import CLIP, LR, WEIGHT_DECAY, synchronize
from host_overhead import StepProfile, micro
from transformers import AutoModelForCausalLM, BitsAndBytesConfig
from transformers.models.llama import modeling_llama  # noqa: F401

from pl_lowprec import AMPPrecision, LowPrecisionStrategy, MemoryTracker
from pl_lowprec.demo import TinyLlama
from pl_lowprec.demo.stdlib_text import stdlib_bytes, windows
from pl_lowprec.memory.estimate import estimate_memory
from pl_lowprec.memory.process import memory_stats, reset_peak
from pl_lowprec.models import CausalLM

warnings.filterwarnings("ignore")

LORA = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": "all-linear"}


def lora_settings(args: argparse.Namespace) -> dict[str, Any]:
    """LoRA for both stacks: ``--lora-r`` (alpha twice the rank), else r=8 alpha 16."""
    return LORA | ({"r": args.lora_r, "lora_alpha": 2 * args.lora_r} if args.lora_r else {})


DTYPES = {"32-true": torch.float32, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def model_kwargs(hidden: int, layers: int, seq: int) -> dict[str, Any]:
    """The TinyLlama every stack trains (and ``estimate_memory`` predicts)."""
    return dict(
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_layers=layers,
        num_heads=max(4, hidden // 64),
        max_len=seq,
        lr=LR,
        warmup_steps=1,
    )


class AdamWLlama(TinyLlama):
    """TinyLlama with the optimizer both stacks use: AdamW on the trainable parameters, constant LR."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)


def batches(args: argparse.Namespace) -> list[dict[str, torch.Tensor]]:
    tokens = torch.frombuffer(bytearray(stdlib_bytes(400_000)), dtype=torch.uint8).long()
    rows = windows(tokens, args.seq)[: args.steps * args.batch]
    return [{"input_ids": r} for r in rows]


def current(dev: torch.device) -> int:
    return torch.cuda.memory_allocated(dev) if dev.type == "cuda" else memory_stats(dev)["rss_current"]


def baseline(dev: torch.device) -> int:
    """Memory in use now (before the model exists); peaks are reset so that they start from here."""
    now = current(dev)
    reset_peak(dev)
    return now


def peak(dev: torch.device) -> int:
    stats = memory_stats(dev)
    return stats["cuda_max_allocated"] if dev.type == "cuda" else stats["rss_peak"]


class PeakBeforeReset(pl.Callback):
    """The peak when fit starts (the model loaded) with the memory held then, and the peak in ``setup``: before
    MemoryTracker, after it in the callbacks, resets it there for its own per-stage figure."""

    def __init__(self) -> None:
        self.peak = self.current = self.peak_at_setup = 0

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self.peak_at_setup = peak(trainer.strategy.root_device)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.peak = peak(trainer.strategy.root_device)
        self.current = current(trainer.strategy.root_device)


class Record(pl.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self.losses: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        synchronize()
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *a: Any) -> None:
        synchronize()
        self.times.append(time.perf_counter() - self.start)
        self.losses.append(float(outputs["loss"]))


class ProfileStep(pl.Callback):
    """``--profile-step``: profiles the run's last step (``host_overhead.StepProfile``), one past the timed ones."""

    def __init__(self, index: int) -> None:
        self.index, self.profile = index, StepProfile()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx == self.index and torch.cuda.is_available():
            self.profile.start()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, outputs: Any, batch: Any, idx: int) -> None:
        if idx == self.index and torch.cuda.is_available():
            self.profile.stop()


def decoder_layer(pretrained: str | None) -> str:
    """The checkpointed block's class: the checkpoint's architecture's decoder layer (Qwen2DecoderLayer), else
    the TinyLlama's (LlamaDecoderLayer)."""
    if pretrained is None:
        return "LlamaDecoderLayer"
    architecture = json.loads((Path(pretrained) / "config.json").read_text())["architectures"][0]
    return architecture.removesuffix("ForCausalLM") + "DecoderLayer"


def lightning_trainer(
    args: argparse.Namespace, dev: torch.device, callbacks: list[pl.Callback], root: str
) -> pl.Trainer:
    """The Trainer both Lightning stacks train with: ``LowPrecisionStrategy`` set from ``--mode`` and
    ``--checkpointing``, ``AMPPrecision`` under a "-mixed" precision, nothing logged or saved."""
    settings: dict[str, Any] = {}
    if args.mode in ("lora", "qlora"):
        settings["lora"] = lora_settings(args)
    if args.mode == "qlora":
        settings["quantization"] = "nf4-dq"
    if args.checkpointing:
        settings["activation_checkpointing"] = [decoder_layer(args.pretrained)]
        settings["checkpoint_impl"] = args.checkpoint_impl
    settings |= dict(args.strategy_arg)  # last: --strategy-arg activation_checkpointing=auto overrides --checkpointing
    mixed = args.precision.endswith("-mixed")
    return pl.Trainer(
        accelerator=dev.type,
        devices=1,
        max_steps=args.steps,
        strategy=LowPrecisionStrategy(**settings),
        plugins=[AMPPrecision(args.precision)] if mixed else [],
        precision=None if mixed else args.precision,
        gradient_clip_val=CLIP,
        callbacks=callbacks,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=root,  # MemoryTracker writes memory_summary.json there, not into the working directory
    )


def run_lightning(args: argparse.Namespace, root: str) -> dict[str, Any]:
    dev = device()
    loader = torch.utils.data.DataLoader(batches(args), batch_size=args.batch)
    start = baseline(dev)
    record, before_reset, tracker = Record(), PeakBeforeReset(), MemoryTracker(print_summary=False)
    callbacks = [before_reset, tracker, record] if args.breakdown else [record]
    trainer = lightning_trainer(args, dev, callbacks, root)
    model = AdamWLlama(**model_kwargs(args.hidden, args.layers, args.seq))
    torch.manual_seed(0)  # LoRA initialisation, as on the hf side
    trainer.fit(model, loader)
    measured = max(before_reset.peak_at_setup, peak(dev)) - start  # MemoryTracker resets in setup
    result = {"times": record.times, "losses": record.losses, "measured_peak": measured}
    if args.breakdown:
        result["at_fit_start"] = before_reset.current - start
    return result | ({"breakdown": tracker.summary["fit"]["bytes"]} if args.breakdown else {})


class AdamWCausalLM(CausalLM):
    """CausalLM with the optimizer both stacks use: AdamW on the trainable parameters, constant LR."""

    def configure_optimizers(self) -> torch.optim.Optimizer:
        params = [p for p in self.parameters() if p.requires_grad]
        return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)


def labelled_batches(args: argparse.Namespace) -> list[dict[str, torch.Tensor]]:
    return [{"input_ids": b["input_ids"], "labels": b["input_ids"]} for b in batches(args)]


def run_causal_lm(args: argparse.Namespace, root: str) -> dict[str, Any]:
    dev = device()
    loader = torch.utils.data.DataLoader(labelled_batches(args), batch_size=args.batch)
    start = baseline(dev)
    record, loaded, profiled = Record(), PeakBeforeReset(), ProfileStep(args.steps - 1)
    trainer = lightning_trainer(args, dev, [loaded, record] + [profiled] * args.profile_step, root)
    dtype = str(DTYPES[args.precision]).removeprefix("torch.")
    chunk = {0: None, -1: "auto"}.get(args.loss_chunk_size, args.loss_chunk_size)  # 0: all at once, -1: auto
    model = AdamWCausalLM(args.pretrained, loss_chunk_size=chunk, dtype=dtype)
    predicted = predict(
        args, trainer, loader, lambda: AdamWCausalLM(args.pretrained, loss_chunk_size=chunk, dtype=dtype)
    )
    torch.manual_seed(0)  # LoRA initialisation, as on the hf side
    trainer.fit(model, loader)
    return (
        {
            "times": record.times,
            "losses": record.losses,
            "measured_peak": peak(dev) - start,
            "after_load": loaded.current - start,
            "load_peak": loaded.peak - start,
        }
        | predicted
        | chosen_settings(trainer)
        | {"step_profile": profiled.profile.figures}
    )


def predict(args: argparse.Namespace, trainer: pl.Trainer, loader: Any, build: Any) -> dict[str, Any]:
    """``--predict``: the estimate of the strategy's settings as given, before anything loads (an automatic
    choice replaces it with the estimate of what it chose: ``chosen_settings``)."""
    if not args.predict:
        return {}
    estimate = estimate_memory(
        build,
        next(iter(loader)),
        precision=args.precision,
        device=device(),
        config=trainer.strategy.transform_config,
    )
    step_time = getattr(estimate, "step_time", None)
    return {"predicted_peak": estimate.peak, "predicted_step_s": getattr(step_time, "seconds", None)} | ops(estimate)


def ops(estimate: Any) -> dict[str, Any]:
    """The simulated step's kernels (``OpProfile``), so that another step-time model can be replayed on them."""
    profile = getattr(estimate, "ops", None)
    if profile is None:
        return {}
    return {"ops": [[*key, n] for key, n in profile.counts.items()], "ops_compiled": profile.compiled}


def chosen_settings(trainer: pl.Trainer) -> dict[str, Any]:
    """What the strategy's automatic choice chose, with its estimate, where it made one."""
    choice = getattr(trainer.strategy, "automatic_choice", None)
    if choice is None:
        return {}
    step_time = getattr(choice.estimate, "step_time", None)
    return {
        "chosen": choice.settings.describe(),
        "predicted_peak": choice.estimate.peak,
        "predicted_step_s": getattr(step_time, "seconds", None),
    } | ops(choice.estimate)


def run_hf(args: argparse.Namespace, root: str) -> dict[str, Any]:
    dev = device()
    data = labelled_batches(args)
    start = baseline(dev)
    dtype = DTYPES[args.precision]
    quantization = None
    if args.mode == "qlora":
        quantization = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
        )
    model = AutoModelForCausalLM.from_pretrained(
        args.pretrained, quantization_config=quantization, dtype=dtype, device_map={"": dev.type}
    )
    if args.mode == "qlora":
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=args.checkpointing)
    elif args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.mode != "full":
        torch.manual_seed(0)  # LoRA initialisation, as on the lightning side
        model = peft.get_peft_model(model, peft.LoraConfig(**lora_settings(args)))
    loaded = {"after_load": current(dev) - start, "load_peak": peak(dev) - start}
    profiled = StepProfile()
    profiling = args.profile_step and torch.cuda.is_available()

    def on_step(when: str, global_step: int) -> None:  # the last step, one past the timed ones
        if profiling and (when, global_step) == ("begin", args.steps - 1):
            profiled.start()
        elif profiling and (when, global_step) == ("end", args.steps):
            profiled.stop()

    times, losses = hf_trainer.train(
        model, data, batch=args.batch, steps=args.steps, precision=args.precision, output_dir=root, on_step=on_step
    )
    figures = {"times": times, "losses": losses, "measured_peak": peak(dev) - start}
    return figures | loaded | {"step_profile": profiled.figures}


def strategy_argument(text: str) -> tuple[str, Any]:
    """``key=value`` with the value read as YAML (``compile=true``, ``checkpoint_every_n=2``)."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE, e.g. compile=true")
    return key, yaml.safe_load(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stack", choices=["lightning", "causal-lm", "hf"], default="lightning")
    parser.add_argument("--mode", choices=["full", "lora", "qlora"], default="qlora")
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--precision", choices=sorted(DTYPES), default="32-true")
    parser.add_argument("--checkpoint-impl", choices=["non_reentrant", "reentrant"], default="non_reentrant")
    parser.add_argument("--loss-chunk-size", type=int, default=256, help="causal-lm: 0 for no chunks, -1 for 'auto'")
    parser.add_argument("--breakdown", action="store_true", help="lightning: add MemoryTracker's breakdown")
    parser.add_argument("--pretrained", help="a save_pretrained directory of the same model (causal-lm, hf stacks)")
    parser.add_argument("--predict", action="store_true", help="causal-lm: add the predicted peak (and step time)")
    parser.add_argument(
        "--profile-step",
        action="store_true",
        help="one more step, profiled (CUDA kernels, busy time; not timed), and the host's time per kernel",
    )
    parser.add_argument("--lora-r", type=int, default=0, help="LoRA rank (alpha twice it); default r=8 alpha 16")
    parser.add_argument(
        "--strategy-arg",
        action="append",
        default=[],
        type=strategy_argument,
        metavar="KEY=YAML",
        help="lightning/causal-lm: one more LowPrecisionStrategy argument, e.g. compile=true (repeatable)",
    )
    args = parser.parse_args()
    if args.stack != "lightning" and not args.pretrained:
        parser.error(f"--stack {args.stack} loads the base from a checkpoint: pass --pretrained DIR")
    run = {"lightning": run_lightning, "causal-lm": run_causal_lm, "hf": run_hf}[args.stack]
    host = micro(device()) if args.profile_step else {}
    args.steps += args.profile_step  # the profiled step is the last, and not timed
    with tempfile.TemporaryDirectory() as root:
        result = run(args, root)
    if args.profile_step:
        result |= {"times": result["times"][:-1], "losses": result["losses"][:-1], "host": host}
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
