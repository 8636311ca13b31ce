"""How long an estimate takes as the accumulation window grows: the micro-batches after two that ran alike counted
(as shipped, ``pl_lowprec/memory/accumulation.py``) against every micro-batch simulated, side by side in one
process, with the figures each gives. Llama-3.1-8B's shapes from its config.json alone (nothing is allocated), QLoRA
nf4-dq r=16, every block checkpointed, bf16-mixed on CUDA, 1 x 2048 tokens a micro-batch.

python benchmarks/estimate_accumulation.py [--windows 1 4 16] [--model 8b]
"""

from __future__ import annotations

import argparse
import functools
import json
import tempfile
import time
from pathlib import Path

import torch
from model_shapes import SHAPES

from pl_lowprec import estimate_memory
from pl_lowprec.memory import fake_step
from pl_lowprec.models import CausalLM
from pl_lowprec.transforms.config import TransformConfig


def estimate(directory: str, window: int, count_repeats: bool) -> tuple[float, object]:
    config = TransformConfig(quantization="nf4-dq", lora={"r": 16}, activation_checkpointing=["LlamaDecoderLayer"])
    tokens = torch.ones(1, 2048, dtype=torch.long)
    original = fake_step.ran_alike
    if not count_repeats:
        fake_step.ran_alike = lambda *records: False  # every micro-batch simulated, as before the change
    try:
        started = time.perf_counter()
        result = estimate_memory(
            functools.partial(CausalLM, pretrained=directory),
            {"input_ids": tokens, "labels": tokens},
            precision="bf16-mixed",
            device="cuda",
            config=config,
            accumulate_grad_batches=window,
            time_on="H200",
        )
        return time.perf_counter() - started, result
    finally:
        fake_step.ran_alike = original


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--model", default="8b", choices=sorted(SHAPES))
    args = parser.parse_args()
    directory = tempfile.mkdtemp()
    Path(directory, "config.json").write_text(json.dumps(SHAPES[args.model]))
    estimate(directory, 1, count_repeats=True)  # the imports and first-call caches, out of the first row
    print("| micro-batches | every one simulated | counted after two alike | speed-up | peak, both | H200 step, both |")
    print("|---|---|---|---|---|---|")
    for window in args.windows:
        every_seconds, every = estimate(directory, window, count_repeats=False)
        counted_seconds, counted = estimate(directory, window, count_repeats=True)
        same = counted.peak == every.peak and counted.ops.counts == every.ops.counts
        peak = f"{counted.peak / 2**30:.2f} GiB" if same else f"{counted.peak} vs {every.peak}: DIFFERENT"
        step = counted.step_time.seconds
        assert step == every.step_time.seconds, (step, every.step_time.seconds)
        print(
            f"| {window} | {every_seconds:.1f} s | {counted_seconds:.1f} s"
            f" ({counted.repeated_micro_batches} counted) | {every_seconds / counted_seconds:.2f}x | {peak}"
            f" | {step:.3f} s |",
            flush=True,
        )


if __name__ == "__main__":
    main()
