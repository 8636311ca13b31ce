"""QLoRA from a pretrained checkpoint: pl_lowprec's streaming load + CausalLM against Hugging Face's recipe.

Run: python benchmarks/run_all.py --only pretrained_vs_hf   (or python benchmarks/pretrained_vs_hf.py [--rounds 3])

The base is a Llama of about 100M parameters (hidden 768, 8 layers, MLP 2048, vocab 32000, untied head), random
weights written once with ``save_pretrained`` as bf16 safetensors. Both stacks load that directory, quantize
every linear layer of the blocks to nf4 with double quantization, add LoRA r=8 (alpha 16) on all linear layers,
checkpoint each decoder layer and train on the same batches in the same order (AdamW lr 1e-3, weight decay
0.01, clipping at 1.0).

- Hugging Face: ``AutoModelForCausalLM.from_pretrained(dir, quantization_config=BitsAndBytesConfig(nf4,
  double quant, compute dtype), dtype=compute dtype)``, ``prepare_model_for_kbit_training`` (with its gradient
  checkpointing), ``get_peft_model``, transformers' ``Trainer``.
- pl_lowprec: ``CausalLM(pretrained=dir, loss_chunk_size=256)`` built on the meta device, filled by
  ``LowPrecisionStrategy(quantization="nf4-dq", lora=..., activation_checkpointing=["LlamaDecoderLayer"])`` as
  the tensors stream in, ``AMPPrecision``.

Precision: the machine's choice (``choose_precision``: bf16-mixed on a GPU with bf16, 32-true on a CPU without
AMX/avx512_bf16), or ``--precision``. Each run is a fresh process (``train_once.py``); rounds alternate which
stack goes first; a ratio is pl_lowprec / Hugging Face within a round (median and min-max over rounds).
pl_lowprec runs twice: with its default non-reentrant checkpointing, and with the reentrant kind that
``prepare_model_for_kbit_training`` turns on (non-reentrant runs Python hooks per saved tensor, which shows when
a small model leaves the GPU waiting for the CPU).
Memory above the baseline taken after the imports: CUDA ``max_memory_allocated``, CPU peak resident set.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from typing import Any

import torch
from common import device, markdown_table, ratio, rounds, section, with_spread, write_json
from training_memory import train_once

from pl_lowprec import choose_precision

HF = "transformers Trainer + peft + BitsAndBytesConfig"
OURS = "pl_lowprec CausalLM + LowPrecisionStrategy"
REENTRANT = "pl_lowprec, checkpoint_impl='reentrant' (as peft's recipe)"
AUTO = "pl_lowprec, the shipped automatic settings (memory_saving, activation_checkpointing, loss chunks: auto)"
AUTO_ARGS = ["--strategy-arg", "memory_saving=auto", "--strategy-arg", "activation_checkpointing=auto"]
SHAPE = {"hidden": 768, "layers": 8, "intermediate": 2048, "heads": 12, "vocab": 32000}
TARGET = {"peak_memory_ratio": 0.8, "step_time_ratio": 0.8}  # issue 28: CPU step and peak <= 0.8x
MiB = 2**20


def write_base(directory: str) -> int:
    """The ~100M-parameter Llama, saved as bf16 safetensors; returns its parameter count."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        hidden_size=SHAPE["hidden"],
        intermediate_size=SHAPE["intermediate"],
        num_hidden_layers=SHAPE["layers"],
        num_attention_heads=SHAPE["heads"],
        num_key_value_heads=SHAPE["heads"],
        vocab_size=SHAPE["vocab"],
        max_position_embeddings=2048,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    return sum(p.numel() for p in model.parameters())


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gpu = device().type == "cuda"
    parser.add_argument("--rounds", type=int, default=3 if gpu else 1, help="default: 3 on a GPU, 1 on a CPU")
    parser.add_argument("--batch", type=int, default=8 if gpu else 2)
    parser.add_argument("--seq", type=int, default=512 if gpu else 128)
    parser.add_argument("--steps", type=int, default=30 if gpu else 5)
    parser.add_argument("--warmup", type=int, default=5 if gpu else 2, help="first steps left out of the timing")
    parser.add_argument("--precision", default=None, help="default: choose_precision for this machine")
    args = parser.parse_args(argv)
    precision = args.precision or choose_precision(device()).precision
    shape = ["--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps)]
    shape += ["--precision", precision, "--checkpointing"]
    with tempfile.TemporaryDirectory() as base:
        params = write_base(base)
        contenders = {
            HF: lambda: train_once("hf", "qlora", False, *shape, "--pretrained", base),
            OURS: lambda: train_once("causal-lm", "qlora", False, *shape, "--pretrained", base),
            REENTRANT: lambda: train_once(
                "causal-lm", "qlora", False, *shape, "--pretrained", base, "--checkpoint-impl", "reentrant"
            ),
            AUTO: lambda: train_once(
                "causal-lm", "qlora", False, *shape, "--pretrained", base, *AUTO_ARGS, "--loss-chunk-size", "-1"
            ),
        }
        runs = rounds(contenders, args.rounds)
    step = {name: [statistics.median(r["times"][args.warmup :]) for r in rs] for name, rs in runs.items()}
    figures = {
        key: {name: [r[key] for r in rs] for name, rs in runs.items()}
        for key in ("measured_peak", "after_load", "load_peak")
    }
    summary = {
        "peak_memory_ratio": ratio(figures["measured_peak"][OURS], figures["measured_peak"][HF]),
        "after_load_ratio": ratio(figures["after_load"][OURS], figures["after_load"][HF]),
        "load_peak_ratio": ratio(figures["load_peak"][OURS], figures["load_peak"][HF]),
        "step_time_ratio": ratio(step[OURS], step[HF]),
        "reentrant_peak_memory_ratio": ratio(figures["measured_peak"][REENTRANT], figures["measured_peak"][HF]),
        "reentrant_step_time_ratio": ratio(step[REENTRANT], step[HF]),
        "auto_peak_memory_ratio": ratio(figures["measured_peak"][AUTO], figures["measured_peak"][HF]),
        "auto_step_time_ratio": ratio(step[AUTO], step[HF]),
    }
    section(
        f"Pretrained QLoRA against Hugging Face: Llama {params / 1e6:.0f}M params (vocab {SHAPE['vocab']}, bf16"
        f" safetensors), nf4-dq + LoRA r=8 + checkpointing, {precision}, batch {args.batch} x {args.seq},"
        f" {device().type.upper()}, {args.rounds} rounds"
    )
    mib = {key: {name: statistics.median(v) / MiB for name, v in fig.items()} for key, fig in figures.items()}
    rows = [
        (
            name,
            mib["load_peak"][name],
            mib["after_load"][name],
            mib["measured_peak"][name],
            statistics.median(step[name]),
        )
        for name in (HF, OURS, REENTRANT, AUTO)
    ]
    headers = ["stack", "load peak MiB", "held after load MiB", "peak over load + train MiB", "step s (median)"]
    print(markdown_table(headers, rows))
    for key, value in summary.items():
        base_key = key.removeprefix("reentrant_").removeprefix("auto_")
        target = f" (target <= {TARGET[base_key]})" if base_key in TARGET else ""
        print(f"{key}: {with_spread(value)}{target}")
    losses = {name: rs[0]["losses"][:3] for name, rs in runs.items()}
    print(f"first losses: {losses}")
    payload = {"precision": precision, "params": params, "args": vars(args), "runs": runs, "summary": summary}
    write_json("pretrained_vs_hf", payload)
    return summary


if __name__ == "__main__":
    main()
