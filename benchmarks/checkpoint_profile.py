"""Where non-reentrant checkpointing's extra step time goes, on this CPU: none / non-reentrant / reentrant, profiled.

Run: python benchmarks/checkpoint_profile.py
The H100 run of ``pretrained_vs_hf`` measured non-reentrant checkpointing 14% slower than reentrant. No GPU here;
this is the same recipe on the CPU: ``CausalLM`` over a saved Llama (hidden 256, MLP 688, 4 layers, 4 heads,
vocab 2048), ``LowPrecisionStrategy(quantization="nf4-dq", lora=r 8, activation_checkpointing=LlamaDecoderLayer)``,
fp32, batch 4 x 256, AdamW. Each setting is one ``Trainer.fit``: 3 warm-up steps, 8 timed steps (median), then 4
steps under ``torch.profiler`` (CPU). From the profile: the aten and bitsandbytes op calls per step and their
summed self time; "outside ops" is the profiled step time minus that (Python, the autograd engine, hooks,
Lightning), the share that a GPU cannot hide when the host is what it waits for.
"""

from __future__ import annotations

import itertools
import statistics
import tempfile
import time
from typing import Any

import lightning.pytorch as pl
import torch
from common import markdown_table, quiet_trainer, section, write_json

from pl_lowprec import LowPrecisionStrategy

WARM, TIMED, PROFILED = 3, 8, 4
BATCH, SEQ = 4, 256
SETTINGS = {"none": None, "non_reentrant": "non_reentrant", "reentrant": "reentrant"}


def write_base(directory: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=256, intermediate_size=688, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
        vocab_size=2048, max_position_embeddings=SEQ, tie_word_embeddings=False,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(directory)


class Profile(pl.Callback):
    """Times steps WARM..WARM+TIMED, then profiles the next PROFILED steps."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.profiler: torch.profiler.profile | None = None
        self.profiled_seconds = 0.0

    def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
        self.stamps.append(time.perf_counter())
        if batch_idx == WARM + TIMED:
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.profiler.__enter__()
            self.profile_start = time.perf_counter()

    def on_train_end(self, trainer, module) -> None:
        self.profiled_seconds = time.perf_counter() - self.profile_start
        self.profiler.__exit__(None, None, None)


def run(directory: str, impl: str | None) -> dict[str, Any]:
    from pl_lowprec.models import CausalLM

    checkpointing = {"activation_checkpointing": ["LlamaDecoderLayer"], "checkpoint_impl": impl} if impl else {}
    strategy = LowPrecisionStrategy(quantization="nf4-dq", lora={"r": 8, "lora_alpha": 16}, **checkpointing)
    profile = Profile()
    steps = WARM + TIMED + PROFILED
    ids = torch.randint(0, 2048, (steps * BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": row, "attention_mask": torch.ones_like(row), "labels": row} for row in ids]
    trainer = quiet_trainer(strategy=strategy, precision="32-true", max_steps=steps, callbacks=[profile])
    torch.manual_seed(0)
    trainer.fit(CausalLM(directory, warmup_steps=1), torch.utils.data.DataLoader(data, batch_size=BATCH))
    stamps = profile.stamps[WARM : WARM + TIMED + 1]
    timed = [b - a for a, b in itertools.pairwise(stamps)]
    ops = [e for e in profile.profiler.key_averages() if e.key.startswith(("aten::", "bitsandbytes::"))]
    op_seconds = sum(e.self_cpu_time_total for e in ops) / 1e6 / PROFILED
    profiled_step = profile.profiled_seconds / PROFILED
    return {
        "step_seconds": statistics.median(timed),
        "op_calls_per_step": sum(e.count for e in ops) / PROFILED,
        "op_seconds_per_step": op_seconds,
        "profiled_step_seconds": profiled_step,
        "outside_ops_seconds_per_step": profiled_step - op_seconds,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as directory:
        write_base(directory)

        result = {name: run(directory, impl) for name, impl in SETTINGS.items()}
    base = result["none"]["step_seconds"]
    rows = [
        (name, f"{r['step_seconds']:.3f}", f"{r['step_seconds'] / base:.2f}", f"{r['op_calls_per_step']:.0f}",
         f"{r['op_seconds_per_step']:.3f}", f"{r['outside_ops_seconds_per_step']:.3f}")
        for name, r in result.items()
    ]  # fmt: skip
    section("Checkpointing cost by kind, CausalLM QLoRA (nf4-dq, LoRA r=8), fp32, batch 4 x 256, CPU")
    headers = [
        "checkpointing",
        "step s (median)",
        "step / none",
        "op calls / step",
        "op self s / step",
        "outside ops s",
    ]
    print(markdown_table(headers, rows))
    write_json("checkpoint_profile", result)
    return result


if __name__ == "__main__":
    main()
