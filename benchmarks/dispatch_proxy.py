"""Kernels and bytes per training step, pl_lowprec's shipped QLoRA path against Hugging Face's recipe, counted on
CPU: the proxy of issue 28's GPU benchmark that needs no GPU, and a first check of the step-time prediction.

Run: python benchmarks/run_all.py --only dispatch_proxy   (or python benchmarks/dispatch_proxy.py [--layers 2])

The model has Llama-3.2-1B's shapes (hidden 2048, MLP 8192, 32 heads / 8 KV heads, vocab 128,256, tied
embeddings) with ``--layers`` blocks, random bf16 weights written once with ``save_pretrained``. Both stacks load
that directory, quantize the blocks' linear layers to nf4 with double quantization, add LoRA r=16 (alpha 32) on
every linear layer, checkpoint each decoder layer and train on the same rows under bf16 autocast:

- pl_lowprec: ``configs/finetune-causal-lm.yaml``'s settings with issue 28's rank: ``CausalLM(pretrained=dir,
  loss_chunk_size=256)`` + ``LowPrecisionStrategy(quantization="nf4-dq", lora=..., activation_checkpointing=
  ["LlamaDecoderLayer"])`` + ``AMPPrecision("bf16-mixed")``, one micro-batch a step, Lightning's Trainer.
- Hugging Face: ``from_pretrained(BitsAndBytesConfig(nf4, double quant, bf16))`` + ``prepare_model_for_kbit_training``
  (gradient checkpointing) + ``get_peft_model(r=16, all-linear)`` + ``Trainer`` (bf16, its defaults otherwise,
  gradient clipping at 1.0 included).

One step of each (after the timed ones) runs under ``pl_lowprec.memory.op_counts.CountingMode``, the counting code
of ``estimate_memory``'s step time: kernel launches (ops that run a kernel: no views, allocations or composites),
FLOPs (torch's ``flop_registry``) and bytes moved (inputs read + outputs written). The other steps run without it
and are timed. From the counted kernels the step is also predicted on this CPU (measured peaks) and on an H200
(the device table); for pl_lowprec, ``estimate_memory``'s own prediction from the fake step stands beside them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from common import markdown_table, section, write_json
from model_shapes import LLAMA_3_2_1B  # Llama-3.2-1B's config.json; depth set by --layers

from pl_lowprec import AMPPrecision, LowPrecisionStrategy, estimate_memory
from pl_lowprec.memory.devices import device_spec
from pl_lowprec.memory.op_counts import CountingMode, OpProfile
from pl_lowprec.memory.step_time import StepTime, predict_step_time
from pl_lowprec.models import CausalLM

warnings.filterwarnings("ignore")

LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": "all-linear"}
OURS, HF = "pl_lowprec (CausalLM + LowPrecisionStrategy)", "Hugging Face (bnb + peft + Trainer)"


def write_base(directory: str, layers: int) -> None:
    from transformers import AutoModelForCausalLM, LlamaConfig

    shape = {k: v for k, v in LLAMA_3_2_1B.items() if k not in ("torch_dtype", "use_cache")}  # as measured
    config = LlamaConfig(**{**shape, "num_hidden_layers": layers})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(directory)


def rows(args: argparse.Namespace) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, LLAMA_3_2_1B["vocab_size"], (args.steps * args.batch, args.seq), generator=generator)
    return [{"input_ids": row, "labels": row} for row in ids]


class StepMeter:
    """Times each step; counts the kernels of step ``counted`` (0-based) with ``CountingMode``."""

    def __init__(self, counted: int) -> None:
        self.counted, self.index, self.times = counted, 0, []
        self.mode: CountingMode | None = None
        self.profile = OpProfile()

    def optimizer_step(self) -> None:
        if self.mode is not None:
            self.mode.in_optimizer_step = True

    def begin(self) -> None:
        if self.index == self.counted:
            self.mode = CountingMode()
            self.mode.__enter__()
        self.started = time.perf_counter()

    def end(self) -> None:
        took = time.perf_counter() - self.started
        if self.mode is not None:
            self.mode.__exit__(None, None, None)
            self.profile, self.mode = self.mode.counter.profile, None
        else:
            self.times.append(took)
        self.index += 1


class LightningMeter(pl.Callback):
    def __init__(self, meter: StepMeter) -> None:
        self.meter = meter

    def on_train_batch_start(self, *args: Any) -> None:
        self.meter.begin()

    def on_before_optimizer_step(self, *args: Any) -> None:
        self.meter.optimizer_step()

    def on_train_batch_end(self, *args: Any) -> None:
        self.meter.end()


def run_ours(base: str, args: argparse.Namespace) -> StepMeter:
    meter = StepMeter(counted=args.steps - 1)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=args.steps,
        strategy=LowPrecisionStrategy(quantization="nf4-dq", lora=LORA, activation_checkpointing=["LlamaDecoderLayer"]),
        plugins=[AMPPrecision("bf16-mixed")],
        callbacks=[LightningMeter(meter)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    loader = torch.utils.data.DataLoader(rows(args), batch_size=args.batch)
    trainer.fit(CausalLM(base, loss_chunk_size=256), loader)
    return meter


def run_hf(base: str, args: argparse.Namespace, root: str) -> StepMeter:
    import peft
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, Trainer, TrainerCallback, TrainingArguments

    meter = StepMeter(counted=args.steps - 1)
    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    model = AutoModelForCausalLM.from_pretrained(
        base, quantization_config=quantization, dtype=torch.bfloat16, device_map={"": "cpu"}
    )
    model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
    torch.manual_seed(0)
    model = peft.get_peft_model(model, peft.LoraConfig(**LORA))

    class HFMeter(TrainerCallback):
        def on_step_begin(self, *a: Any, **k: Any) -> None:
            meter.begin()

        def on_pre_optimizer_step(self, *a: Any, **k: Any) -> None:
            meter.optimizer_step()

        def on_step_end(self, *a: Any, **k: Any) -> None:
            meter.end()

    training_args = TrainingArguments(
        output_dir=root,
        per_device_train_batch_size=args.batch,
        max_steps=args.steps,
        bf16=True,
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    Trainer(model=model, args=training_args, train_dataset=rows(args), callbacks=[HFMeter()]).train()
    return meter


def predicted_by_estimate(base: str, args: argparse.Namespace) -> tuple[OpProfile, float]:
    """``estimate_memory``'s fake step of the pl_lowprec run: its kernels, and the seconds the estimate took."""
    batch = {k: torch.stack([r[k] for r in rows(args)[: args.batch]]) for k in ("input_ids", "labels")}
    started = time.perf_counter()
    estimate = estimate_memory(
        lambda: CausalLM(base, loss_chunk_size=256),
        batch,
        precision="bf16-mixed",
        quantization="nf4-dq",
        lora=LORA,
        activation_checkpointing=["LlamaDecoderLayer"],
    )
    return estimate.ops, time.perf_counter() - started


def _row(name: str, profile: OpProfile, measured: float | None, cpu: StepTime, gpu: StepTime) -> list[Any]:
    return [
        name,
        f"{profile.launches:,}",
        f"{profile.flops / 1e9:,.1f}",
        f"{profile.bytes / 1e9:,.2f}",
        "" if measured is None else f"{measured:.2f}",
        f"{cpu.seconds:.2f}",
        "" if measured is None else f"{cpu.seconds / measured:.2f}",
        f"{gpu.seconds * 1e3:.1f}",
    ]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2, help="decoder blocks of Llama-3.2-1B's shape (of 16)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=4, help="the first is warm-up, the last is counted")
    args = parser.parse_args(argv)
    cpu, h200 = device_spec("cpu"), device_spec("H200")
    with tempfile.TemporaryDirectory() as root:
        base = str(Path(root) / "base")
        write_base(base, args.layers)
        ours = run_ours(base, args)
        hf = run_hf(base, args, str(Path(root) / "hf"))
        estimated, estimate_seconds = predicted_by_estimate(base, args)
    measured = {name: statistics.median(m.times[1:]) for name, m in ((OURS, ours), (HF, hf))}
    profiles = {OURS: ours.profile, HF: hf.profile, "estimate_memory's fake step (pl_lowprec)": estimated}
    section(
        f"Kernels per training step on CPU: Llama-3.2-1B shapes with {args.layers} of 16 blocks, QLoRA nf4-dq r=16,"
        f" checkpointing, bf16 autocast, batch {args.batch} x {args.seq}"
    )
    table = []
    for name, profile in profiles.items():
        table.append(
            _row(
                name,
                profile,
                measured.get(name),
                predict_step_time(profile, cpu),
                predict_step_time(profile, h200),
            )
        )
    headers = [
        "counted in",
        "kernel launches",
        "GFLOP",
        "GB moved",
        "CPU step s (measured)",
        "CPU step s (predicted)",
        "predicted / measured",
        "H200 step ms (predicted)",
    ]
    print(markdown_table(headers, table))
    ratios = {
        "launches": ours.profile.launches / hf.profile.launches,
        "bytes": ours.profile.bytes / hf.profile.bytes,
        "cpu_step_measured": measured[OURS] / measured[HF],
        "h200_step_predicted": predict_step_time(ours.profile, h200).seconds
        / predict_step_time(hf.profile, h200).seconds,
    }
    print(
        f"pl_lowprec / Hugging Face: launches {ratios['launches']:.2f}x, bytes {ratios['bytes']:.2f}x, CPU step"
        f" {ratios['cpu_step_measured']:.2f}x (measured), H200 step {ratios['h200_step_predicted']:.2f}x"
        f" (predicted from the counted kernels). This CPU as measured: {cpu.flops['bf16'] / 1e9:,.0f} GFLOP/s"
        f" bf16, {cpu.flops['fp32'] / 1e9:,.0f} fp32, {cpu.bandwidth / 1e9:,.1f} GB/s, {cpu.launch_overhead * 1e6:.1f}"
        f" us a dispatch. The estimate took {estimate_seconds:.1f} s."
    )
    payload = {
        "args": vars(args),
        "measured_step_seconds": {name: m.times for name, m in ((OURS, ours), (HF, hf))},
        "profiles": {
            name: {"launches": p.launches, "flops": p.flops, "bytes": p.bytes} for name, p in profiles.items()
        },
        "ratios": ratios,
        "cpu": {"flops": cpu.flops, "bandwidth": cpu.bandwidth, "launch_overhead": cpu.launch_overhead},
    }
    write_json("dispatch_proxy", json.loads(json.dumps(payload, default=str)))
    return ratios


if __name__ == "__main__":
    main()
