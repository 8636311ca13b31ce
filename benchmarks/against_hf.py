"""QLoRA with pl_lowprec against the Hugging Face recipe, same base, batches, LoRA, optimizer and seed.

Run: python benchmarks/run_all.py --only against_hf   (or python benchmarks/against_hf.py [--rounds 3])

The base (a TinyLlama, hidden 512, 4 layers) is written once with ``save_pretrained``. Hugging Face side:
``AutoModelForCausalLM.from_pretrained(dir, quantization_config=BitsAndBytesConfig(load_in_4bit=True,
bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=float32))``,
``prepare_model_for_kbit_training``, ``get_peft_model``, transformers' ``Trainer``. pl_lowprec side:
``Trainer(strategy=LowPrecisionStrategy(quantization="nf4-dq", lora=...))`` on the same weights. LoRA r=8 on
all linear layers, AdamW (lr 1e-3, weight decay 0.01), clipping at 1.0, batch 4 x 256, fp32 compute, 5 steps
(the first 2 not timed).
Each run is a fresh process (``train_once.py``); rounds alternate which stack goes first. A ratio is
pl_lowprec / Hugging Face within a round; its median and min-max over rounds are printed.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from typing import Any

from common import device, markdown_table, ratio, rounds, section, with_spread, write_json
from train_once import model_kwargs
from training_memory import SHAPE, WARMUP, train_once

from pl_lowprec.demo import TinyLlama

HF, OURS = "transformers Trainer + peft + BitsAndBytesConfig", "pl_lowprec"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as base:
        TinyLlama(**model_kwargs(SHAPE["hidden"], SHAPE["layers"], SHAPE["seq"])).model.save_pretrained(base)
        contenders = {
            HF: lambda: train_once("hf", "qlora", False, "--pretrained", base),
            OURS: lambda: train_once("lightning", "qlora", False),
        }
        runs = rounds(contenders, args.rounds)
    step = {name: [statistics.median(r["times"][WARMUP:]) for r in rs] for name, rs in runs.items()}
    peak = {name: [r["measured_peak"] for r in rs] for name, rs in runs.items()}
    summary = {
        "step_time_ratio": ratio(step[OURS], step[HF]),
        "peak_memory_ratio": ratio(peak[OURS], peak[HF]),
    }
    gap = max(
        abs(a - b)
        for ours, hf in zip(runs[OURS], runs[HF], strict=True)
        for a, b in zip(ours["losses"], hf["losses"], strict=True)
    )
    section(
        f"Against Hugging Face: QLoRA nf4-dq + LoRA r=8, TinyLlama hidden {SHAPE['hidden']}, {SHAPE['layers']} layers, "
        f"batch {SHAPE['batch']} x {SHAPE['seq']}, fp32 compute, {device().type.upper()}, {args.rounds} rounds"
    )
    rows = [(name, statistics.median(step[name]), statistics.median(peak[name]) / 2**20) for name in (HF, OURS)]
    print(markdown_table(["stack", "step s (median)", "peak MiB above baseline (median)"], rows))
    print(
        f"\npl_lowprec / Hugging Face, median (min-max) over {args.rounds} rounds: step time "
        f"{with_spread(summary['step_time_ratio'])}, peak memory {with_spread(summary['peak_memory_ratio'])}"
    )
    steps = len(runs[OURS][0]["losses"])
    print(f"Loss curves: largest per-step difference {gap:.1e} over {steps} steps x {args.rounds} rounds")
    result = {"runs": runs, "summary": summary, "max_loss_gap": gap}
    write_json("against_hf", result)
    return result


if __name__ == "__main__":
    main()
