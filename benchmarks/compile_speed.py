"""Eager against compiled step time (``compile=``), LoRA and QLoRA with checkpointing, and what really compiled.

Run: python benchmarks/run_all.py --only compile
or, with other sizes (a Llama-3.2-1B-wide block on a GPU, say):
    python benchmarks/compile_speed.py --hidden 2048 --intermediate 8192 --heads 32 --batch 2 --seq 2048
A Llama (``TinyLlama``: hidden 256, MLP 688, 4 decoder layers, 4 heads, vocab 256), LoRA r=8 on every linear
layer, every decoder layer checkpointed (non-reentrant), batch 4 x 256. Each model goes through the strategy's
own ``ModelTransform`` (what ``LowPrecisionStrategy`` runs in ``setup``): fp32 LoRA, fp32 QLoRA (bitsandbytes
NF4), and the shipped recipe, QLoRA nf4-dq under bf16-mixed (frozen weights in bf16, the norms' and LoRA's autocast
hooks; eager also fuses the LoRA SwiGLU MLP, which ``compile=`` leaves to inductor). Compiled: each decoder layer,
as ``compile=True`` does, with an empty inductor cache (a fresh ``TORCHINDUCTOR_CACHE_DIR``: a second run on a warm
cache compiles several times faster). The first compiled step compiles; its time, torch._dynamo's compile seconds
over the whole run, the graphs it compiled and its graph breaks (``compile_report.CompileWatch``, what the INFO
line reports) are shown apart. After one more untimed step each, the eager and compiled models take steps in
rotating order; the table shows the median. It runs on the GPU where there is one (steps timed between
``torch.cuda.synchronize()`` calls), else on the CPU, whose figure says little about a GPU: there the op
dispatch that compile removes is a larger share of the step, and the kernels are Triton's, not C++.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from contextlib import nullcontext
from typing import Any

import torch
from common import device, markdown_table, ratio, rounds, section, with_spread, write_json
from lightning.pytorch.plugins.precision import Precision

from pl_lowprec import AMPPrecision
from pl_lowprec.demo import TinyLlama
from pl_lowprec.transforms.compile_report import CompileWatch
from pl_lowprec.transforms.config import TransformConfig
from pl_lowprec.transforms.pipeline import ModelTransform

DEVICE = device()
RUNS = {  # name: (quantization, precision)
    "LoRA, fp32": (None, "32-true"),
    "QLoRA nf4, fp32": ("nf4", "32-true"),
    "QLoRA nf4-dq, bf16-mixed": ("nf4-dq", "bf16-mixed"),
}


def build(quantization: str | None, precision: str, compile: bool, args: argparse.Namespace) -> TinyLlama:
    torch.manual_seed(0)
    model = TinyLlama(
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_layers=args.layers,
        num_heads=args.heads,
        max_len=args.seq,
    )
    config = TransformConfig(
        quantization=quantization, lora={"r": 8}, activation_checkpointing="LlamaDecoderLayer", compile=compile
    )
    plugin = AMPPrecision(precision) if precision.endswith("-mixed") else Precision()
    ModelTransform(config).apply(model, plugin, DEVICE)  # as the strategy's setup: quantized layers on DEVICE
    return model.to(DEVICE)  # and the rest, as Lightning moves the module after it


def step(model: TinyLlama, ids: torch.Tensor, precision: str) -> float:
    autocast = torch.autocast(DEVICE.type, dtype=torch.bfloat16) if precision == "bf16-mixed" else nullcontext()
    synchronize()
    start = time.perf_counter()
    with autocast:
        loss = model.model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    synchronize()
    return time.perf_counter() - start


def synchronize() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=688)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS), metavar="RUN")
    args = parser.parse_args(argv)
    ids = torch.randint(0, 256, (args.batch, args.seq), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="pl_lowprec_inductor_")  # a cold compile
    result, rows = {}, []
    for name in args.runs:
        quantization, precision = RUNS[name]
        eager, compiled = build(quantization, precision, False, args), build(quantization, precision, True, args)
        step(eager, ids, precision)  # warm-up
        torch._dynamo.reset()  # each run compiles its own graphs
        watch = CompileWatch()
        first = step(compiled, ids, precision)
        step(compiled, ids, precision)
        times = rounds(
            {
                "eager": lambda m=eager, p=precision: step(m, ids, p),
                "compiled": lambda m=compiled, p=precision: step(m, ids, p),
            },
            args.rounds,
        )
        activity = watch.activity()
        speed = ratio(times["eager"], times["compiled"])
        breaks = sum(activity.graph_breaks.values())
        result[name] = {
            "eager_step_seconds": statistics.median(times["eager"]),
            "compiled_step_seconds": statistics.median(times["compiled"]),
            "speedup": speed,
            "first_compiled_step_seconds": first,
            "compile_seconds": activity.seconds,
            "graphs": activity.graphs,
            "graph_breaks": breaks,
            "recompiles": [f"{f.function}: {f.recompile_reason}" for f in activity.recompiles],
        }
        rows.append(
            (name, f"{statistics.median(times['eager']):.3f}", f"{statistics.median(times['compiled']):.3f}",
             with_spread(speed, 2), f"{first:.1f}", f"{activity.seconds:.1f}", activity.graphs, breaks)
        )  # fmt: skip
    section(
        f"compile=: TinyLlama hidden {args.hidden}, MLP {args.intermediate}, {args.layers} layers, LoRA r=8, every"
        f" layer checkpointed, batch {args.batch} x {args.seq}, on {DEVICE.type}; median of {args.rounds} rounds"
    )
    headers = [
        "run",
        "eager step s",
        "compiled step s",
        "eager / compiled (min-max)",
        "first step s",
        "compile s",
        "graphs",
        "graph breaks",
    ]
    print(markdown_table(headers, rows))
    write_json("compile", result)
    return result


if __name__ == "__main__":
    main()
