"""Eager against compiled step time (``compile=``), LoRA and QLoRA with checkpointing, and what really compiled.

Run: python benchmarks/run_all.py --only compile
A Llama (``TinyLlama``: hidden 256, MLP 688, 4 decoder layers, 4 heads, vocab 256), LoRA r=8 on every linear
layer, every decoder layer checkpointed (non-reentrant), batch 4 x 256. Each model goes through the strategy's
own ``ModelTransform`` (what ``LowPrecisionStrategy`` runs in ``setup``): fp32 LoRA, fp32 QLoRA (bitsandbytes
NF4), and the shipped recipe, QLoRA nf4-dq under bf16-mixed (frozen weights in bf16, the norms' and LoRA's autocast
hooks; eager also fuses the LoRA SwiGLU MLP, which ``compile=`` leaves to inductor). Compiled: each decoder layer,
as ``compile=True`` does, with an empty inductor cache (a fresh ``TORCHINDUCTOR_CACHE_DIR``: a second run on a warm
cache compiles several times faster). The first compiled step compiles; its time, torch._dynamo's compile seconds
over the whole run, the graphs it compiled and its graph breaks (``compile_report.CompileWatch``, what the INFO
line reports) are shown apart. After one more untimed step each, the eager and compiled models take steps in
rotating order; the table shows the median. A CPU figure: on a GPU the op-dispatch overhead that compile removes
is a larger share of the step, and the kernels are Triton's, not C++.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from contextlib import nullcontext
from typing import Any

import torch
from common import markdown_table, ratio, rounds, section, with_spread, write_json
from lightning.pytorch.plugins.precision import Precision

from pl_lowprec import AMPPrecision
from pl_lowprec.demo import TinyLlama
from pl_lowprec.transforms.compile_report import CompileWatch
from pl_lowprec.transforms.config import TransformConfig
from pl_lowprec.transforms.pipeline import ModelTransform

ROUNDS, BATCH, SEQ = 11, 4, 256
RUNS = {  # name: (quantization, precision)
    "LoRA, fp32": (None, "32-true"),
    "QLoRA nf4, fp32": ("nf4", "32-true"),
    "QLoRA nf4-dq, bf16-mixed": ("nf4-dq", "bf16-mixed"),
}


def build(quantization: str | None, precision: str, compile: bool) -> TinyLlama:
    torch.manual_seed(0)
    model = TinyLlama(hidden_size=256, intermediate_size=688, num_layers=4, num_heads=4, max_len=SEQ)
    config = TransformConfig(
        quantization=quantization, lora={"r": 8}, activation_checkpointing="LlamaDecoderLayer", compile=compile
    )
    plugin = AMPPrecision(precision) if precision.endswith("-mixed") else Precision()
    ModelTransform(config).apply(model, plugin, torch.device("cpu"))
    return model


def step(model: TinyLlama, ids: torch.Tensor, precision: str) -> float:
    autocast = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16-mixed" else nullcontext()
    start = time.perf_counter()
    with autocast:
        loss = model.model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ids = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="pl_lowprec_inductor_")  # a cold compile
    result, rows = {}, []
    for name, (quantization, precision) in RUNS.items():
        eager, compiled = build(quantization, precision, False), build(quantization, precision, True)
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
            ROUNDS,
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
        "compile=: TinyLlama hidden 256, 4 layers, LoRA r=8, every layer checkpointed, batch 4 x 256;"
        f" median of {ROUNDS} rounds"
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
