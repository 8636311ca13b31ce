"""Bytes saved for backward by an 8-block TinyGPT, plain and with activation checkpointing; same gradients.

Run: python benchmarks/run_all.py --only activation_checkpointing
TinyGPT (dim 32, 8 blocks, 2 heads), batch 4 x 63 next-byte targets, fp32, one forward and backward, counted
by ``pl_lowprec.memory.activations.count_saved_tensors`` (the count ``MemoryTracker`` reports). Exact bytes.
"""

from __future__ import annotations

from typing import Any

import torch
from common import markdown_table, section, write_json

from pl_lowprec import set_activation_checkpointing
from pl_lowprec.demo.tiny_gpt import TinyGPT
from pl_lowprec.memory.activations import count_saved_tensors

SETUPS = {"plain": None, "every block": 1, "every other block (checkpoint_every_n=2)": 2}


def saved_bytes_and_grads(every_n: int | None) -> tuple[int, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = TinyGPT(dim=32, layers=8, heads=2, max_len=64)
    if every_n is not None:
        set_activation_checkpointing(model, "Block", every_n=every_n)
    ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1))
    with count_saved_tensors(model) as counter:
        model._loss({"input_ids": ids}).backward()
    return counter.nbytes, {n: p.grad for n, p in model.named_parameters()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    measured = {name: saved_bytes_and_grads(every_n) for name, every_n in SETUPS.items()}
    plain_bytes, plain_grads = measured["plain"]
    result, rows = {}, []
    for name, (nbytes, grads) in measured.items():
        gap = max((grads[k] - plain_grads[k]).abs().max().item() for k in plain_grads)
        result[name] = {"saved_bytes": nbytes, "ratio": nbytes / plain_bytes, "max_grad_difference": gap}
        rows.append((name, nbytes, f"{nbytes / 1e6:.2f}", f"{nbytes / plain_bytes:.0%}", f"{gap:.1e}"))
    section("Activation checkpointing: bytes saved for backward, TinyGPT dim 32, 8 blocks, batch 4 x 63, fp32")
    print(markdown_table(["setup", "bytes", "MB", "of plain", "largest gradient difference"], rows))
    write_json("activation_checkpointing", result)
    return result


if __name__ == "__main__":
    main()
