"""The CPU step-time prediction against the run it predicts: what ``fit`` prints at its end, for four workloads,
with the kernels timed at their shapes (``pl_lowprec/memory/kernel_replay.py``, shipped) and on the roofline alone.

Run: python benchmarks/cpu_step_prediction.py [--steps 12] [--busy 2]

Each workload is a ``Trainer.fit`` with ``LowPrecisionStrategy`` and ``"auto"`` settings, as a user runs it: the
strategy predicts the step before loading, and its ``StepClock`` takes the median step from step 3 on. The
"roofline only" column predicts the same simulated step (``strategy.prediction.ops``) on the same measured CPU
with ``kernel_seconds=None``: the prediction before kernel replay. "Threads only" times every kernel again on
torch's threads alone (``kernel_replay.BUSY`` infinite): the prediction before ``timed_on_free_cores``. "No fresh
pages" predicts it with ``fresh_page_seconds=0``: the prediction before the first writes to fresh pages were
counted (``op_counts.FRESH_PAGES``). "With the host floor's rest" is a candidate host term, not shipped: the
quickstart's model at hidden 64 and batch 1 x 16 (``fit_vs_plain_loop.py``'s host floor, whose kernels take almost
nothing) is fitted too, and what its step takes beyond its prediction, per kernel, is added for each workload's
kernels.

``--busy N`` runs it all beside N other processes, each a loop of 512-square matmuls on 2 threads, as a laptop's
other work: the predictions should stay near the idle ones while the measured steps slow down.

- quickstart: ``configs/quickstart.yaml``'s model, data and strategy (TinyLlama hidden 128, 2 layers, batch 8 x
  128, nf4-dq, LoRA r=8);
- TinyLlama hidden 512, MLP 1408, 2 layers, 8 heads, batch 4 x 512, the same strategy;
- Llama-3.2-1B shapes with 2 of 16 blocks (``dispatch_proxy.py``'s model, random bf16 weights), ``CausalLM``
  with ``loss_chunk_size=256``, nf4-dq, LoRA r=16 on every linear layer, every block checkpointed, batch 1 x 256;
- SmolLM2-135M shapes with 2 of 30 blocks (tied embeddings, a 49,152-row vocabulary, 9 / 3 heads, hidden 576,
  random bf16 weights), ``CausalLM`` with ``loss_chunk_size="auto"``, nf4-dq, LoRA r=8 on every linear layer, batch
  8 x 512: ``configs/finetune-causal-lm.yaml`` at ``--data.seq_len 512``, the user's path where the fp32 logits
  (0.8 GB a batch) make a few GiB of fresh pages a step.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import describe_machine, machine_info, markdown_table, quiet_trainer, section, write_json
from dispatch_proxy import write_base
from model_shapes import SHAPES
from torch.utils.data import DataLoader

from pl_lowprec import AMPPrecision, LowPrecisionStrategy
from pl_lowprec.demo import StdlibTextDataModule, TinyLlama
from pl_lowprec.memory import kernel_replay
from pl_lowprec.memory.devices import local_cpu
from pl_lowprec.memory.step_time import predict_step_time
from pl_lowprec.models import CausalLM

warnings.filterwarnings("ignore")

QUICKSTART_LORA = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": "all-linear"}
LORA_16 = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": "all-linear"}
# ``_tiny``'s arguments (hidden, MLP, heads, sequence, batch); fit_vs_plain_loop.py fits the same two
QUICKSTART = (128, 352, 4, 128, 8)
HOST_FLOOR = (64, 176, 4, 16, 1)  # the kernels take almost nothing: the step is the host's work
BUSY_LOOP = "import torch\ntorch.set_num_threads(2)\na = torch.randn(512, 512)\nwhile True:\n    a @ a"


def _tiny(hidden: int, mlp: int, heads: int, seq: int, batch: int) -> tuple[Any, Any, dict[str, Any]]:
    model = TinyLlama(hidden_size=hidden, intermediate_size=mlp, num_layers=2, num_heads=heads, max_len=seq)
    strategy = {"quantization": "nf4-dq", "lora": QUICKSTART_LORA}
    return model, StdlibTextDataModule(seq_len=seq, batch_size=batch), strategy


def _llama_1b_two_blocks(root: str) -> tuple[Any, Any, dict[str, Any]]:
    base = str(Path(root) / "base")
    write_base(base, 2)
    ids = torch.randint(0, 128_000, (256,), generator=torch.Generator().manual_seed(0))
    rows = DataLoader([{"input_ids": ids, "labels": ids}] * 64, batch_size=1)
    strategy = {"quantization": "nf4-dq", "lora": LORA_16, "activation_checkpointing": ["LlamaDecoderLayer"]}
    return CausalLM(base, loss_chunk_size=256), rows, strategy


def _smollm2_two_blocks(root: str) -> tuple[Any, Any, dict[str, Any]]:
    from transformers import AutoModelForCausalLM, LlamaConfig

    base = str(Path(root) / "smollm2")
    torch.manual_seed(0)
    config = LlamaConfig(**{**SHAPES["smollm2-135m"], "num_hidden_layers": 2})
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(base)
    ids = torch.randint(0, 49152, (64, 512), generator=torch.Generator().manual_seed(0))
    rows = DataLoader([{"input_ids": row, "labels": row} for row in ids], batch_size=8)
    return CausalLM(base, loss_chunk_size="auto"), rows, {"quantization": "nf4-dq", "lora": QUICKSTART_LORA}


def measure(build: Callable[[], tuple[Any, Any, dict[str, Any]]], steps: int) -> dict[str, Any]:
    torch.manual_seed(0)
    model, data, settings = build()
    settings = {"activation_checkpointing": "auto", "memory_saving": "auto", **settings}
    strategy = LowPrecisionStrategy(**settings)
    trainer = quiet_trainer(
        max_steps=steps, limit_val_batches=0, plugins=[AMPPrecision(precision="auto")], strategy=strategy
    )
    trainer.fit(model, data)
    clock, estimate = strategy.step_clock, strategy.prediction
    roofline = predict_step_time(estimate.ops, dataclasses.replace(local_cpu(), kernel_seconds=None))
    no_fresh = predict_step_time(estimate.ops, dataclasses.replace(local_cpu(), fresh_page_seconds=0.0))
    return {
        "measured": clock.median,
        "predicted": clock.predicted.seconds,
        "roofline_only": roofline.seconds,
        "no_fresh_pages": no_fresh.seconds,
        "fresh_bytes": clock.predicted.fresh_bytes,
        "threads_only": _threads_only(estimate.ops),
        "kernels": clock.predicted.launches,
        "timed_kernels": clock.predicted.timed_kernels,
        "one_thread_kernels": clock.predicted.one_thread_kernels,
    }


def _threads_only(ops: Any) -> float:
    """The same step predicted with every kernel and rate timed on torch's threads alone, as before
    ``timed_on_free_cores``; the process's timings are dropped before and after, so each side times afresh."""
    shipped = kernel_replay.BUSY

    def forget() -> None:
        kernel_replay.forget_timings()
        local_cpu.cache_clear()

    forget()
    kernel_replay.BUSY = math.inf
    try:
        return predict_step_time(ops, local_cpu()).seconds
    finally:
        kernel_replay.BUSY = shipped
        forget()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per run; the median is from step 3")
    parser.add_argument("--busy", type=int, default=0, help="other processes busy on the cores meanwhile")
    args = parser.parse_args(argv)
    print(describe_machine(machine_info()))
    results = {}
    others = [subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) for _ in range(args.busy)]
    with tempfile.TemporaryDirectory() as root:
        workloads = {
            "quickstart (TinyLlama 128, 2 layers, 8 x 128)": lambda: _tiny(*QUICKSTART),
            "TinyLlama 512, 2 layers, 4 x 512": lambda: _tiny(512, 1408, 8, 512, 4),
            "Llama-3.2-1B shapes, 2 blocks, 1 x 256": lambda: _llama_1b_two_blocks(root),
            "SmolLM2-135M shapes, 2 blocks, 8 x 512": lambda: _smollm2_two_blocks(root),
        }
        try:
            for name, build in workloads.items():
                results[name] = measure(build, args.steps)
            floor = measure(lambda: _tiny(*HOST_FLOOR), args.steps)
        finally:
            for other in others:
                other.kill()
    # A candidate host term: what the host floor's step takes beyond its prediction, per kernel, charged to each
    # workload's kernels (the Python around them that the prediction leaves out, measured on this host).
    rest = (floor["measured"] - floor["predicted"]) / floor["kernels"]
    for r in results.values():
        r["with_host_rest"] = r["predicted"] + rest * r["kernels"]
    beside = f" beside {args.busy} busy processes" if args.busy else ""
    section(f"CPU step time: fit's median step against its prediction before loading{beside}")
    rows = [
        [
            name,
            f"{r['kernels']:,} ({r['timed_kernels']:,}; {r['one_thread_kernels']:,})",
            r["measured"],
            r["predicted"],
            r["predicted"] / r["measured"],
            f"{r['no_fresh_pages']:.3f} ({r['fresh_bytes'] / 2**30:.2f} GiB)",
            r["threads_only"],
            r["roofline_only"],
            r["roofline_only"] / r["measured"],
            r["with_host_rest"] / r["measured"],
        ]
        for name, r in results.items()
    ]
    headers = [
        "workload",
        "kernels (timed at their shapes; on one thread)",
        "measured s",
        "predicted s (shipped)",
        "predicted / measured",
        "no fresh pages s (their GiB)",
        "threads only s",
        "roofline only s",
        "roofline only / measured",
        "with the host floor's rest / measured",
    ]
    print(markdown_table(headers, rows))
    print(
        f"Host floor (TinyLlama 64, 2 layers, 1 x 16): {floor['measured']:.4f} s measured, {floor['predicted']:.4f} s"
        f" predicted, {floor['kernels']:,} kernels: {rest * 1e6:.1f} us a kernel left out of the prediction."
    )
    write_json("cpu_step_prediction", {"steps": args.steps, "busy": args.busy, "results": results, "host_floor": floor})
    return results


if __name__ == "__main__":
    main()
