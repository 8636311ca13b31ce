"""Selective checkpointing between none and every block: activation bytes and step time, in one run.

Run: python benchmarks/run_all.py --only selective_checkpointing
A Llama (``TinyLlama``: hidden 256, MLP 688, 4 decoder layers, 4 heads, vocab 256) with LoRA r=8 on every linear
layer, fp32, batch 4 x 256 tokens. Activation bytes are those saved for backward by one forward, counted by
``count_saved_tensors`` (what ``MemoryTracker`` reports; selective checkpointing's kept outputs included). Step time
is one forward and backward, median over rounds in rotating order, one warm-up step each.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from common import markdown_table, rounds, section, write_json

from pl_lowprec import set_activation_checkpointing
from pl_lowprec.demo import TinyLlama
from pl_lowprec.memory.activations import count_saved_tensors
from pl_lowprec.transforms.lora import inject_lora, lora_config

SETUPS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "selective, every block": {"mode": "selective"},
    "full, every other block (checkpoint_every_n=2)": {"every_n": 2},
    "full, every block": {},
}
ROUNDS, BATCH, SEQ = 11, 4, 256


def build(setup: dict[str, Any] | None) -> TinyLlama:
    torch.manual_seed(0)
    model = TinyLlama(hidden_size=256, intermediate_size=688, num_layers=4, num_heads=4, max_len=SEQ)
    inject_lora(model, lora_config({"r": 8}))
    if setup is not None:
        set_activation_checkpointing(model, "LlamaDecoderLayer", **setup)
    return model


def step(model: TinyLlama, ids: torch.Tensor) -> float:
    start = time.perf_counter()
    model.model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ids = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    models = {name: build(setup) for name, setup in SETUPS.items()}
    saved = {}
    for name, model in models.items():
        with count_saved_tensors(model) as counter:
            loss = model.model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()  # also the warm-up step
        saved[name] = counter.nbytes
    times = rounds({name: lambda m=model: step(m, ids) for name, model in models.items()}, ROUNDS)
    base_bytes, base_time = saved["none"], statistics.median(times["none"])
    result, rows = {}, []
    for name in SETUPS:
        median = statistics.median(times[name])
        result[name] = {"saved_bytes": saved[name], "step_seconds": median, "step_seconds_all": times[name]}
        rows.append(
            (name, f"{saved[name] / 2**20:.1f}", f"{saved[name] / base_bytes:.0%}", f"{median:.3f}",
             f"{median / base_time:.2f}")
        )  # fmt: skip
    section(
        "Selective checkpointing: TinyLlama hidden 256, 4 layers, LoRA r=8, fp32, batch 4 x 256;"
        f" step = forward + backward, median of {ROUNDS} rounds"
    )
    print(markdown_table(["checkpointing", "activation MiB", "of none", "step s", "step / none"], rows))
    write_json("selective_checkpointing", result)
    return result


if __name__ == "__main__":
    main()
