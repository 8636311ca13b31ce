"""One training run in a fresh process, so that its peak RSS is its own; prints one JSON line.

python benchmarks/train_once.py --stack {lightning,hf,plain} --mode {full,lora,qlora} [--checkpointing]
    [--steps N] [--hidden H] [--layers L] [--batch B] [--seq T] [--precision bf16-mixed]

lightning: Trainer + AMPPrecision + LowPrecisionStrategy + MemoryTracker (its breakdown is in the output).
hf: transformers Trainer + peft (prepare_model_for_kbit_training, get_peft_model) on the same quantized model.
Both see the same batches in the same order, the same LoRA config and seed, AdamW (lr 1e-3, weight decay 0.01),
clipping at 1.0, constant LR.
"""

from __future__ import annotations

import argparse
import json
import time
import warnings

import torch

warnings.filterwarnings("ignore")

LR, WEIGHT_DECAY, CLIP = 1e-3, 0.01, 1.0
LORA = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0}


def batches(args: argparse.Namespace) -> list[dict[str, torch.Tensor]]:
    from pl_lowprec.demo.stdlib_text import stdlib_bytes, windows

    tokens = torch.frombuffer(bytearray(stdlib_bytes(400_000)), dtype=torch.uint8).long()
    rows = windows(tokens, args.seq)[: args.steps * args.batch]
    return [{"input_ids": r} for r in rows]


def build(args: argparse.Namespace):
    from pl_lowprec.demo import TinyLlama

    return TinyLlama(
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 11 // 4,
        num_layers=args.layers,
        num_heads=max(4, args.hidden // 64),
        max_len=args.seq,
        lr=LR,
        warmup_steps=1,
    )


def rss_peak() -> int:
    from pl_lowprec.memory.process import memory_stats

    return memory_stats(torch.device("cpu"))["rss_peak"]


def run_lightning(args: argparse.Namespace) -> dict:
    import lightning.pytorch as pl

    from pl_lowprec import AMPPrecision, LowPrecisionStrategy, MemoryTracker

    times, losses = [], []

    class Record(pl.Callback):
        def on_train_batch_start(self, *a):
            self.t = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, *a):
            times.append(time.perf_counter() - self.t)
            losses.append(float(outputs["loss"]))

    class AdamW(type(build(args))):
        def configure_optimizers(self):
            params = [p for p in self.parameters() if p.requires_grad]
            return torch.optim.AdamW(params, lr=LR, weight_decay=WEIGHT_DECAY)

    settings = {}
    if args.mode in ("lora", "qlora"):
        settings["lora"] = {**LORA, "target_modules": "all-linear"}
    if args.mode == "qlora":
        settings["quantization"] = "nf4-dq"
    if args.checkpointing:
        settings["activation_checkpointing"] = ["LlamaDecoderLayer"]
    tracker = MemoryTracker(print_summary=False)
    trainer = pl.Trainer(
        accelerator="cpu",
        max_steps=args.steps,
        strategy=LowPrecisionStrategy(**settings),
        plugins=[AMPPrecision(args.precision)] if args.precision.endswith("mixed") else [],
        gradient_clip_val=CLIP,
        callbacks=[tracker, Record()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    model = AdamW(**dict(build(args).hparams))
    loader = torch.utils.data.DataLoader(batches(args), batch_size=args.batch)
    torch.manual_seed(0)  # LoRA initialisation
    trainer.fit(model, loader)
    return {"times": times, "losses": losses, "rss_peak": rss_peak(), "breakdown": tracker.summary["fit"]["bytes"]}


def run_hf(args: argparse.Namespace) -> dict:
    import peft
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from pl_lowprec.quantization import QuantizationConfig, quantize_model

    model = build(args).model
    if args.mode == "qlora":
        quantize_model(model, QuantizationConfig.from_mode("nf4-dq"), torch.bfloat16, torch.device("cpu"))
        model.is_loaded_in_4bit = True
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=args.checkpointing)
    elif args.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if args.mode != "full":
        torch.manual_seed(0)  # LoRA initialisation
        model = peft.get_peft_model(model, peft.LoraConfig(**LORA, target_modules="all-linear"))
    times, losses = [], []

    class Record(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t)

        def on_log(self, _args, state, control, logs=None, **k):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    class InOrder(Trainer):
        def _get_train_sampler(self, *a, **k):
            return torch.utils.data.SequentialSampler(self.train_dataset)

    data = [{"input_ids": b["input_ids"], "labels": b["input_ids"]} for b in batches(args)]
    training_args = TrainingArguments(
        output_dir="/tmp/pl_lowprec_hf_bench",
        per_device_train_batch_size=args.batch,
        max_steps=args.steps,
        learning_rate=LR,
        weight_decay=WEIGHT_DECAY,
        max_grad_norm=CLIP,
        lr_scheduler_type="constant",
        bf16=args.precision == "bf16-mixed",
        use_cpu=True,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=0,
    )
    InOrder(model=model, args=training_args, train_dataset=data, callbacks=[Record()]).train()
    return {"times": times, "losses": losses, "rss_peak": rss_peak()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stack", choices=["lightning", "hf"], default="lightning")
    parser.add_argument("--mode", choices=["full", "lora", "qlora"], default="qlora")
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--precision", default="bf16-mixed")
    args = parser.parse_args()
    result = run_lightning(args) if args.stack == "lightning" else run_hf(args)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
