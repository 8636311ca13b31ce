"""What a device can do per second, for the step-time prediction: peak FLOP/s by dtype, memory bandwidth, and
the host's time per kernel launch.

GPUs come from their spec sheets (dense tensor-core figures, no sparsity; fp32 without TF32, PyTorch's default
for matmuls), scaled by the achievable fractions below. The local CPU is measured once per process instead
(``local_cpu``, well under a second): its spec sheet (``lscpu``) gives neither the rate torch's matmul kernels reach
on it nor its memory bandwidth, and on a CPU shared with other work the measurement is what a step will see.

Calibration (change the constants here, in one place). On an H200 (``benchmarks/step_time_calibration.py``,
docs/memory.md) a large bf16 matmul reached 0.80 of the peak and a large copy 0.88 of the bandwidth; the lower
0.7 and 0.8 predict whole steps of plain PyTorch models (a mix of smaller matmuls) within 7%. The launch overhead
(host time per kernel in an eager step: Python, the dispatcher, autograd, ``cudaLaunchKernel``; 32 us measured
for a small plain-PyTorch model) was set from issue 28's two H200 figures of the shipped QLoRA path with Hugging
Face and peft modules (batch 2 x 2048: 0.45 s a step at Llama-3.2-1B shapes, 0.95 s at Llama-3.1-8B shapes) as
the value that predicts both within the 25% target (0.372 s, -17%, and 1.104 s, +16%): a fit to two figures,
not a check. It belongs to the host, so every GPU gets the same.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pl_lowprec.memory.collectives import NVLINK_AMPERE, NVLINK_HOPPER, PCIE, PCIE_GEN3, Interconnect
from pl_lowprec.memory.kernel_replay import KernelTime, best_seconds, kernel_seconds, timed_on_free_cores
from pl_lowprec.memory.op_counts import CountingMode

MATMUL_EFFICIENCY = 0.7  # of the spec sheet's dense peak, reached by large bf16 cuBLAS matmuls (H100/H200)
MEMORY_EFFICIENCY = 0.8  # of the spec sheet's bandwidth, reached by large elementwise kernels and copies
LAUNCH_OVERHEAD = 38e-6  # seconds of host time per kernel launch in an eager training step (see above)
TERA = 1e12


@dataclass(frozen=True)
class DeviceSpec:
    """Peak FLOP/s by dtype name (``"bf16"``, ``"fp16"``, ``"fp32"``, ``"fp8"``; a missing one is not supported),
    bandwidth in bytes/s, host seconds per kernel launch, and the fractions of the peaks that kernels reach.

    ``asynchronous``: the host launches the next kernel while the device runs this one (GPUs), so an op takes
    the longest of its FLOPs, its bytes and its launch; on a CPU the same cores dispatch and compute, so the
    dispatch adds to the kernel.

    Measured on a CPU only (``local_cpu``; the GPUs' rows leave them empty): ``attention_flops``, the FLOP/s of
    the fused attention kernels by dtype (a CPU's flash attention reaches about a tenth of its matmul rate;
    where absent, attention runs at the matmul rate), and ``matmul_latency``, the seconds a matmul takes beyond
    its FLOPs and its dispatch by dtype (the math library's setup and its threads' start: about 14 us in bf16
    on an AVX-512 CPU, more than a small matmul's FLOPs take).

    ``kernel_seconds`` (the local CPU's: ``kernel_replay.kernel_seconds``) times a kernel at its own shapes from
    its call's label and its roofline time, or gives ``None`` where the roofline serves.

    ``fresh_page_seconds``: the seconds per byte the first write to freshly mapped pages costs beyond a write to
    pages already held (the OS faults them in and zeroes them; ``op_counts.FRESH_PAGES``). A GPU's caching
    allocator keeps its blocks: 0.

    ``interconnect``: how fast ranks on one host exchange tensors (``collectives.py``): NCCL's figures for the
    GPUs' links; none for the local CPU, where gloo's speed is measured by a run with its process group.
    """

    name: str
    flops: dict[str, float] = field(hash=False)
    bandwidth: float
    launch_overhead: float = LAUNCH_OVERHEAD
    matmul_efficiency: float = MATMUL_EFFICIENCY
    memory_efficiency: float = MEMORY_EFFICIENCY
    asynchronous: bool = True
    source: str = "spec sheet"
    attention_flops: dict[str, float] = field(default_factory=dict, hash=False)
    matmul_latency: dict[str, float] = field(default_factory=dict, hash=False)
    kernel_seconds: Callable[[str, float], KernelTime | None] | None = field(default=None, compare=False, repr=False)
    fresh_page_seconds: float = 0.0
    interconnect: Interconnect | None = None  # between ranks on one host; ``None``: not known without measuring

    def flops_per_second(self, dtype: str) -> float:
        """The achievable FLOP/s of matmuls in ``dtype``; refuses a dtype the device does not compute."""
        peak = self.flops.get(dtype)
        if peak is None:
            raise ValueError(
                f"The {self.name} has no {dtype} matmul units (it computes {', '.join(sorted(self.flops))}), so"
                f" a step in {dtype} cannot be timed on it. Use a precision it computes (16-mixed on a T4) or"
                " time the step on another device."
            )
        return peak * self.matmul_efficiency

    def attention_flops_per_second(self, dtype: str) -> float:
        """The FLOP/s of fused attention kernels in ``dtype``: measured on a CPU, the matmul rate elsewhere."""
        return self.attention_flops.get(dtype) or self.flops_per_second(dtype)


def _gpu(
    name: str,
    bf16: float | None,
    fp16: float,
    fp32: float,
    bandwidth_tb: float,
    fp8: float | None = None,
    link: Interconnect = PCIE,
):
    flops = {"fp16": fp16 * TERA, "fp32": fp32 * TERA}
    flops |= {"bf16": bf16 * TERA} if bf16 is not None else {}
    flops |= {"fp8": fp8 * TERA} if fp8 is not None else {}
    return DeviceSpec(name, flops, bandwidth_tb * TERA, interconnect=link)


# Dense peaks (TFLOP/s; fp16/bf16 with fp32 accumulation, as PyTorch runs them) and memory bandwidth (TB/s).
GPUS: dict[str, DeviceSpec] = {
    "H100": _gpu(
        "H100 (SXM, 80 GB)", bf16=989.4, fp16=989.4, fp32=66.9, bandwidth_tb=3.35, fp8=1978.9, link=NVLINK_HOPPER
    ),
    "H200": _gpu(
        "H200 (SXM, 141 GB)", bf16=989.4, fp16=989.4, fp32=66.9, bandwidth_tb=4.8, fp8=1978.9, link=NVLINK_HOPPER
    ),
    "A100": _gpu("A100 (SXM, 80 GB)", bf16=312.0, fp16=312.0, fp32=19.5, bandwidth_tb=2.039, link=NVLINK_AMPERE),
    "L4": _gpu("L4 (24 GB)", bf16=121.0, fp16=121.0, fp32=30.3, bandwidth_tb=0.3, fp8=242.5),
    "RTX4090": _gpu("RTX 4090 (24 GB)", bf16=165.2, fp16=165.2, fp32=82.6, bandwidth_tb=1.008, fp8=330.3),
    "T4": _gpu("T4 (16 GB)", bf16=None, fp16=65.0, fp32=8.1, bandwidth_tb=0.32, link=PCIE_GEN3),
}


def _key(name: str) -> str:
    return re.sub(r"[^A-Z0-9]", "", name.upper()).removeprefix("NVIDIA").removeprefix("GEFORCE")


def device_spec(name: str) -> DeviceSpec:
    """``"cpu"`` (this machine's, measured) or a GPU of the table by name (``"H100"``, ``"h200"``, ``"RTX 4090"``,
    ``"4090"``); any other name is refused with the known ones."""
    if name.lower() == "cpu":
        return local_cpu()
    key = _key(name)
    for known, spec in GPUS.items():
        if key in (known, known.removeprefix("RTX")):
            return spec
    raise ValueError(
        f"No figures for a GPU named {name!r}: the step time is predicted for {', '.join(GPUS)} (peak FLOP/s and"
        " memory bandwidth from their spec sheets) and for cpu (this machine, measured). Name one of them (--gpu"
        " H100, time_on='h100'), or add a row to pl_lowprec/memory/devices.py's GPUS."
    )


def gpu_named(device_name: str) -> str | None:
    """The table's key for a CUDA device name (``torch.cuda.get_device_name()``, e.g. "NVIDIA H100 80GB HBM3"),
    or ``None`` when the table has no such GPU."""
    key = _key(device_name)
    return next((known for known in sorted(GPUS, key=len, reverse=True) if known in key), None)


@functools.cache
def local_cpu() -> DeviceSpec:
    """This CPU, measured once per process (half a second on a 2-core EPYC): matmul FLOP/s per dtype (768-square;
    fp16, which CPUs run slowly, 128-square) and each matmul's latency (a 32-square one less its FLOPs and its
    dispatch), causal flash attention's FLOP/s forward and backward (``_attention_flops``), copy bandwidth (64
    MiB, beyond the caches), the first write to fresh pages (64 MiB allocated and filled, less a fill of pages
    held), and the time of one tiny op with autograd (the dispatch cost each kernel pays).
    Best of a few runs each, so other work on the machine counts least, and the rates on one thread where
    torch's threads waited for busy cores (``timed_on_free_cores``; the name says so); already achievable rates,
    so the efficiencies are 1. Its own random generator: a run's random state (seed_everything, LoRA's initialisation,
    dropout) must not depend on whether this ran first in the process."""
    generator = torch.Generator().manual_seed(0)
    tiny = torch.ones(4, requires_grad=True)

    def hundred_ops() -> None:
        for _ in range(100):
            tiny * 2

    launch = best_seconds(hundred_ops, 3) / 100
    flops, latency, attention, timings = {}, {}, {}, []

    def seconds(run: Callable[[], object], repeats: int) -> float:
        timings.append(timed_on_free_cores(run, repeats))
        return timings[-1].seconds

    for dtype, name, size in (
        (torch.float32, "fp32", 768),
        (torch.bfloat16, "bf16", 768),
        (torch.float16, "fp16", 128),
    ):
        a, b = (torch.randn(size, size, dtype=dtype, generator=generator) for _ in range(2))
        flops[name] = 2 * size**3 / seconds(lambda a=a, b=b: a @ b, 4)
        small = torch.randn(32, 32, dtype=dtype, generator=generator)
        latency[name] = max(0.0, seconds(lambda s=small: s @ s, 5) - 2 * 32**3 / flops[name] - launch)
        if name != "fp16":  # a CPU's fp16 attention is rare (Lightning runs 16-mixed as bf16 there) and slow
            attention[name] = _attention_flops(dtype, generator, seconds)
    source = torch.empty(16 * 2**20, dtype=torch.float32)
    target = torch.empty_like(source)
    bandwidth = 2 * source.nbytes / seconds(lambda: target.copy_(source), 3)
    fresh = max(0.0, seconds(lambda: torch.empty_like(source).fill_(1), 3) - seconds(lambda: target.fill_(1), 3))
    threads = torch.get_num_threads()
    busy = "; its cores were busy: rates of one thread" if any(t.one_thread for t in timings) else ""
    return DeviceSpec(
        f"this CPU ({threads} thread{'s' if threads != 1 else ''}, measured{busy})",
        flops,
        bandwidth,
        launch,
        1.0,
        1.0,
        asynchronous=False,
        source="measured",
        attention_flops=attention,
        matmul_latency=latency,
        kernel_seconds=kernel_seconds,
        fresh_page_seconds=fresh / source.nbytes,
    )


def _attention_flops(
    dtype: torch.dtype, generator: torch.Generator, seconds: Callable[[Callable[[], object], int], float]
) -> float:
    """FLOP/s of causal scaled-dot-product attention forward and backward on this CPU, counted as the step's
    kernels are (``op_counts``), at the shape of a real model's layer: head size 64, 512 positions, 4 heads per
    thread so that every thread has work."""
    heads = 4 * torch.get_num_threads()
    q, k, v = (torch.randn(1, heads, 512, 64, dtype=dtype, generator=generator).requires_grad_() for _ in range(3))

    def forward_and_backward() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), out)

    with CountingMode() as mode:  # attention's kernels are the only ones here with FLOPs
        forward_and_backward()
    return mode.counter.profile.flops / seconds(forward_and_backward, 3)
