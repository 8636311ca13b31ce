"""The host's time per kernel in eager PyTorch on this machine, and where one training step's time goes on a GPU:
the figures the step-time prediction's launch overhead (``pl_lowprec/memory/devices.py``) has to match.

``micro(device)`` times three tiny workloads whose kernels take no device time, so each one's time is host time:
``tiny_op`` (a chain of one-element autograd ops, as ``devices.local_cpu`` times its dispatch), ``lora`` (norm,
frozen linear with a LoRA pair and SiLU, four layers, forward and backward under bf16 autocast) and ``qlora``
(the same on a bitsandbytes 4-bit linear through peft, where both are installed). Each gives seconds per kernel:
the best of a few runs over the kernels one run launches, counted as the prediction counts them (``CountingMode``;
not under the profiler, which can slow a process's later launches).

``StepProfile`` profiles one real training step (``train_once.py --profile-step``): its CUDA kernels, their summed
time, the time the GPU was busy (their union) and the step's wall time; wall minus busy is time the GPU waited.

Run alone: python benchmarks/host_overhead.py  (prints ``micro`` for cuda if there is one, else cpu)
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from pl_lowprec.memory.op_counts import CountingMode


def _kernels(run: Callable[[], None]) -> int:
    """The kernels of one ``run`` as the step-time prediction counts them (``CountingMode``: ops that write a
    tensor), without the profiler: CUPTI, once attached, can slow every later launch of the process."""
    with CountingMode() as mode:
        run()
    return mode.counter.profile.launches


def _seconds_per_kernel(run: Callable[[], None], device: torch.device, repeats: int = 5) -> float:
    def synced() -> None:
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()

    synced()
    synced()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        synced()
        best = min(best, time.perf_counter() - started)
    return best / max(1, _kernels(run))


class _LoRALayer(nn.Module):
    def __init__(self, base: nn.Module, width: int, rank: int = 4) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(width)
        self.base = base
        self.lora_a = nn.Linear(width, rank, bias=False)
        self.lora_b = nn.Linear(rank, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + nn.functional.silu(self.base(h) + self.lora_b(self.lora_a(h)) * 2.0)


def _step(model: nn.Module, x: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            loss = model(x).float().square().mean()
        loss.backward()

    return run


def _qlora(width: int, device: torch.device) -> nn.Module | None:
    try:
        import bitsandbytes as bnb
        import peft
    except ImportError:
        return None
    layers = nn.Sequential()
    for i in range(4):
        base = bnb.nn.Linear4bit(width, width, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4")
        layers.add_module(str(i), nn.Sequential(nn.RMSNorm(width), base))
    layers = layers.to(device)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=[f"{i}.1" for i in range(4)])
    return peft.get_peft_model(layers, config)


def micro(device: torch.device | str) -> dict[str, float]:
    """Host seconds per kernel of ``tiny_op``, ``lora`` and ``qlora`` (where bitsandbytes runs) on ``device``."""
    device = torch.device(device)
    width = 64
    tiny = torch.ones(4, device=device, requires_grad=True)

    def tiny_ops() -> None:
        for _ in range(100):
            tiny * 2

    plain = nn.Sequential(*(_LoRALayer(nn.Linear(width, width, bias=False), width) for _ in range(4))).to(device)
    for layer in plain:
        layer.base.requires_grad_(False)
    x = torch.randn(1, 8, width, device=device, requires_grad=True)
    figures = {"tiny_op": _seconds_per_kernel(tiny_ops, device), "lora": _seconds_per_kernel(_step(plain, x), device)}
    if device.type == "cuda":  # bitsandbytes' 4-bit linear on a CPU is another code path
        try:  # an extra figure: its failure must not end the run it measures
            quantized = _qlora(width, device)
            if quantized is not None:
                figures["qlora"] = _seconds_per_kernel(_step(quantized, x), device)
        except Exception as error:
            print(f"host_overhead: qlora not measured: {error!r}")
    return figures


class StepProfile:
    """Profiles the code between ``start()`` and ``stop()`` (one training step) on CUDA; ``figures`` after."""

    def __init__(self) -> None:
        self.figures: dict[str, Any] = {}
        self._profiler: Any = None

    def start(self) -> None:
        torch.cuda.synchronize()
        self._profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        self._profiler.__enter__()
        self._started = time.perf_counter()

    def stop(self) -> None:
        torch.cuda.synchronize()
        wall = time.perf_counter() - self._started
        self._profiler.__exit__(None, None, None)
        events = self._profiler.events()
        kernels = [  # not the GPU-side copies of record_function ranges (Lightning's hooks): they span the step
            e
            for e in events
            if e.device_type == torch.autograd.DeviceType.CUDA and not getattr(e, "is_user_annotation", False)
        ]
        by_name: dict[str, float] = {}
        for e in kernels:
            by_name[e.name] = by_name.get(e.name, 0.0) + (e.time_range.end - e.time_range.start) / 1e6
        spans = sorted((e.time_range.start, e.time_range.end) for e in kernels)
        busy, end = 0.0, float("-inf")
        for start, stop in spans:  # the union of the kernels' intervals
            if stop > end:
                busy += stop - max(start, end)
                end = stop
        launches = sum(1 for e in events if "LaunchKernel" in e.name)
        self.figures = {
            "kernels": len(kernels),
            "launches": launches,
            "kernel_s": sum(s - b for b, s in spans) / 1e6,
            "busy_s": busy / 1e6,
            "wall_s": wall,  # under the profiler: longer than an unprofiled step
            "top_kernels_s": dict(sorted(by_name.items(), key=lambda kv: -kv[1])[:12]),
        }


if __name__ == "__main__":
    print(json.dumps(micro("cuda" if torch.cuda.is_available() else "cpu")))
