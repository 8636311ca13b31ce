"""Activation bytes on the device and in host memory, with and without checkpointing and offloading.

Run: python benchmarks/offloading_memory.py
The ~26M-parameter TinyLlama of docs/benchmarks.md (hidden 512, 8 layers, batch 8 x 256, bf16-mixed).
``estimate_memory`` runs one fake training step (nothing allocated) under the same saved-tensor hooks that
``LowPrecisionStrategy(activation_offloading=True)`` installs, and counts what stays on the device and what
moves to host memory; ``tests/transforms/test_offloading.py`` checks that these counts equal ``MemoryTracker``'s.
Exact byte counts, no timing: the copies' cost needs a GPU to measure.
"""

from __future__ import annotations

import warnings

import torch

from pl_lowprec import estimate_memory
from pl_lowprec.demo import TinyLlama


def build() -> TinyLlama:
    return TinyLlama(hidden_size=512, intermediate_size=1408, num_layers=8, num_heads=8)


def main() -> None:
    warnings.filterwarnings("ignore", message=r".*self\.log.*")
    batch = {"input_ids": torch.zeros(8, 256, dtype=torch.long)}
    print("| configuration | activations on device MiB | offloaded to host MiB | device total MiB |")
    print("|---|---|---|---|")
    for name, checkpointing, offloading in (
        ("no checkpointing", None, False),
        ("offloading", None, True),
        ("checkpointing", ["LlamaDecoderLayer"], False),
        ("checkpointing + offloading", ["LlamaDecoderLayer"], True),
    ):
        estimate = estimate_memory(
            build,
            batch,
            precision="bf16-mixed",
            activation_checkpointing=checkpointing,
            activation_offloading=offloading,
        )
        mib = [estimate.activations, estimate.activations_offloaded_to_host, estimate.total]
        print(f"| {name} | " + " | ".join(f"{v / 2**20:.1f}" for v in mib) + " |")


if __name__ == "__main__":
    main()
