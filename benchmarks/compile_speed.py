"""Eager against compiled step time (``compile=``), LoRA and QLoRA with checkpointing, compile time apart.

Run: python benchmarks/run_all.py --only compile
A Llama (``TinyLlama``: hidden 256, MLP 688, 4 decoder layers, 4 heads, vocab 256), LoRA r=8 on every linear
layer, every decoder layer checkpointed (non-reentrant), fp32, batch 4 x 256; QLoRA stores the base as
bitsandbytes NF4. Compiled: each decoder layer through ``compile_model``, the function ``compile=True`` runs, with
an empty inductor cache (a fresh ``TORCHINDUCTOR_CACHE_DIR``: a second run on a warm cache compiles several times
faster). The first compiled step compiles (two graphs: the first layer's input needs no gradient, the others'
does); its time and ``torch._dynamo``'s compile seconds over the whole run are reported apart. After one more
untimed step each, the eager and compiled models take steps in rotating order; the table shows the median.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from typing import Any

import torch
from common import markdown_table, ratio, rounds, section, with_spread, write_json

from pl_lowprec import set_activation_checkpointing
from pl_lowprec.demo import TinyLlama
from pl_lowprec.transforms.compiling import compile_model, compile_seconds
from pl_lowprec.transforms.lora import inject_lora, lora_config
from pl_lowprec.transforms.quantization import QuantizationConfig, quantize_model

ROUNDS, BATCH, SEQ = 11, 4, 256


def build(quantize: bool) -> TinyLlama:
    torch.manual_seed(0)
    model = TinyLlama(hidden_size=256, intermediate_size=688, num_layers=4, num_heads=4, max_len=SEQ)
    if quantize:
        quantize_model(model, QuantizationConfig.from_mode("nf4"), torch.float32, torch.device("cpu"))
    inject_lora(model, lora_config({"r": 8}))
    set_activation_checkpointing(model, "LlamaDecoderLayer")
    return model


def step(model: TinyLlama, ids: torch.Tensor) -> float:
    start = time.perf_counter()
    model.model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ids = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="pl_lowprec_inductor_")  # a cold compile
    result, rows = {}, []
    for name, quantize in (("LoRA", False), ("QLoRA (nf4)", True)):
        eager, compiled = build(quantize), build(quantize)
        step(eager, ids)  # warm-up
        compile_model(compiled, "LlamaDecoderLayer", {})
        before = compile_seconds()
        first = step(compiled, ids)
        step(compiled, ids)
        times = rounds({"eager": lambda m=eager: step(m, ids), "compiled": lambda m=compiled: step(m, ids)}, ROUNDS)
        compiling = compile_seconds() - before
        speed = ratio(times["eager"], times["compiled"])
        result[name] = {
            "eager_step_seconds": statistics.median(times["eager"]),
            "compiled_step_seconds": statistics.median(times["compiled"]),
            "speedup": speed,
            "first_compiled_step_seconds": first,
            "compile_seconds": compiling,
        }
        rows.append(
            (name, f"{statistics.median(times['eager']):.3f}", f"{statistics.median(times['compiled']):.3f}",
             with_spread(speed, 2), f"{first:.1f}", f"{compiling:.1f}")
        )  # fmt: skip
    section(
        "compile=: TinyLlama hidden 256, 4 layers, LoRA r=8, every layer checkpointed, fp32, batch 4 x 256;"
        f" median of {ROUNDS} rounds"
    )
    headers = ["run", "eager step s", "compiled step s", "eager / compiled (min-max)", "first step s", "compile s"]
    print(markdown_table(headers, rows))
    write_json("compile", result)
    return result


if __name__ == "__main__":
    main()
