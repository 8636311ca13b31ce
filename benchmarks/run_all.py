"""Every figure in docs/benchmarks.md, side by side, on the machine this runs on.

Run: python benchmarks/run_all.py [--only SECTION ...]
Prints the machine (CPU model, the flags that decide bf16 speed, GPU), the date and the library versions,
then one markdown table per figure, as docs/benchmarks.md shows them; writes ``benchmarks/results/all.json`` (or
``benchmarks/results/<section>.json`` per section run; the folder is untracked). On the 2-core AVX2 CPU the
docs/benchmarks.md names, the whole run takes about 9 minutes; ``--only`` reruns one figure.

Sections (in order):
  overhead                  Trainer + AMPPrecision vs Lightning's MixedPrecision vs the plain loop, fp16 and bf16
  quantized_bytes           bytes per quantized weight, constants included, per mode
  activation_checkpointing  bytes saved for backward by an 8-block TinyGPT, plain / every block / every other
  selective_checkpointing   activation bytes and step time: none / selective / every other block / every block
  compile                   eager vs compile=True step time, LoRA and QLoRA with checkpointing; compile time
  training_memory           full / LoRA / QLoRA x checkpointing, one process each; estimate_memory vs measured peak
  peak_memory               estimate_memory's predicted peak vs the profiler's allocation records, one process each
  fused_ops                 fused LoRA MLP, cross-entropy and norm backward vs the unfused paths: peak, step time
  against_hf                QLoRA against transformers + peft + BitsAndBytesConfig, alternating rounds
  pretrained_vs_hf          the same from a ~100M bf16 checkpoint: streaming load + CausalLM vs HF's recipe
  dispatch_proxy            kernels, FLOPs and bytes per step vs HF's recipe (Llama-3.2-1B shapes); predicted step time
  callbacks                 LossScaleMonitor and MemoryTracker cost, per step and per fit
  quality                   validation perplexity per precision and mode (reported only)
  kbit_prep                 parameter memory after k-bit preparation vs peft
  checkpoint_size           adapter-only vs full Lightning checkpoint
  precision                 step time per precision and what AMPPrecision("auto") chose (README, "auto")
  packing                   padded vs packed batches on log-normal prompt/completion lengths: target tokens/s
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

SECTIONS = {
    "overhead": "overhead",
    "quantized_bytes": "quantized_bytes",
    "activation_checkpointing": "activation_checkpointing",
    "selective_checkpointing": "selective_checkpointing",
    "compile": "compile_speed",
    "training_memory": "training_memory",
    "peak_memory": "peak_memory",
    "fused_ops": "fused_ops",
    "against_hf": "against_hf",
    "pretrained_vs_hf": "pretrained_vs_hf",
    "dispatch_proxy": "dispatch_proxy",
    "callbacks": "callback_overhead",
    "quality": "quality",
    "kbit_prep": "kbit_prep_memory",
    "checkpoint_size": "checkpoint_size",
    "precision": "precision_choice",
    "packing": "packing",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=list(SECTIONS), metavar="SECTION", help=", ".join(SECTIONS))
    args = parser.parse_args()
    from common import describe_machine, machine_info, write_json

    started = time.perf_counter()
    print(f"# pl_lowprec benchmarks\n\n{describe_machine(machine_info())}", flush=True)
    chosen = args.only or list(SECTIONS)
    results, seconds = {}, {}
    for name in chosen:
        start = time.perf_counter()
        results[name] = importlib.import_module(SECTIONS[name]).main([])
        seconds[name] = round(time.perf_counter() - start, 1)
    total = time.perf_counter() - started
    timing = ", ".join(f"{name} {s:.0f} s" for name, s in seconds.items())
    if args.only is None:
        path = write_json("all", {"results": results, "seconds": seconds, "total_seconds": total})
        print(f"\nWrote {path}")
    print(f"\nTotal {total:.0f} s ({timing})")


if __name__ == "__main__":
    main()
