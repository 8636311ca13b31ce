"""The step-time prediction against a GPU: the device table's efficiencies and launch overhead, measured, and
predicted against measured steps of plain PyTorch models from launch-bound to compute-bound.

On the GPU (needs torch only):   python benchmarks/step_time_calibration.py measure --out calibration.json
Then anywhere:                   python benchmarks/step_time_calibration.py compare calibration.json

``measure`` times, with CUDA events and ``torch.cuda.synchronize``: a bf16 and an fp32 matmul (the achieved
fraction of the spec-sheet peak: ``MATMUL_EFFICIENCY``), a 1 GiB copy (``MEMORY_EFFICIENCY``), a chain of tiny
autograd ops (the host's time per kernel in eager PyTorch, without Hugging Face's or peft's Python), and a
training step (bf16 autocast, fp32 weights, torch AdamW) of three GPT-style models in plain PyTorch: the median
step of ``--steps`` after two untimed, and in one profiled step the CUDA kernels launched and the GPU's busy time.
``compare`` predicts the same steps with ``estimate_memory(...).step_time_on(GPU)`` and prints both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

MODELS = {  # name: (width, blocks, heads, vocab, batch rows, sequence length)
    "small (launch-bound)": (256, 4, 4, 1024, 8, 256),
    "medium": (1024, 8, 16, 32000, 4, 1024),
    "large (compute-bound)": (2048, 8, 16, 32000, 4, 2048),
}


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attention = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attention.transpose(1, 2).reshape(b, t, d))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class GPT(nn.Module):
    """Returns the loss of next-token prediction on its batch of token ids."""

    def __init__(self, width: int, blocks: int, heads: int, vocab: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(blocks))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def _gpu_seconds(run: Any, repeats: int = 10) -> float:
    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def measure_device() -> dict[str, float]:
    figures = {}
    for name, dtype, size in (("bf16", torch.bfloat16, 8192), ("fp32", torch.float32, 4096)):
        a, b = torch.randn(size, size, dtype=dtype, device="cuda"), torch.randn(size, size, dtype=dtype, device="cuda")
        figures[f"matmul_{name}_flops"] = 2 * size**3 / _gpu_seconds(lambda a=a, b=b: a @ b)
    source = torch.empty(2**28, dtype=torch.float32, device="cuda")  # 1 GiB
    target = torch.empty_like(source)
    figures["copy_bandwidth"] = 2 * source.nbytes / _gpu_seconds(lambda: target.copy_(source))
    tiny = torch.ones(16, device="cuda", requires_grad=True)

    def chain() -> None:
        x = tiny
        for _ in range(200):
            x = x * 1.0001
        x.sum().backward()

    chain()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(10):
        chain()
    torch.cuda.synchronize()
    figures["host_seconds_per_kernel"] = (time.perf_counter() - started) / 10 / 402  # 200 forward, 201 backward, sum
    return figures


def measure_step(name: str, steps: int) -> dict[str, Any]:
    width, blocks, heads, vocab, rows, seq = MODELS[name]
    torch.manual_seed(0)
    model = GPT(width, blocks, heads, vocab).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, vocab, (rows, seq), device="cuda")

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    times = []
    for index in range(steps + 2):
        torch.cuda.synchronize()
        started = time.perf_counter()
        step()
        torch.cuda.synchronize()
        if index >= 2:
            times.append(time.perf_counter() - started)
    result: dict[str, Any] = {"step_seconds": statistics.median(times), "step_times": times}
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    try:
        with torch.profiler.profile(activities=activities) as profile:
            step()
            torch.cuda.synchronize()
        kernels = [e for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        result["kernels"] = len(kernels)
        result["gpu_busy_seconds"] = sum(e.time_range.elapsed_us() for e in kernels) / 1e6
    except Exception as error:  # the timings stand without the profile
        result["profile_error"] = repr(error)
    return result


def measure(args: argparse.Namespace) -> None:
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, **measure_device(), "steps": {}}
    for name in MODELS:  # written after each, so a run cut short keeps what it measured
        Path(args.out).write_text(json.dumps(result, indent=1))
        result["steps"][name] = measure_step(name, args.steps)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


def compare(args: argparse.Namespace) -> None:
    import dataclasses

    from pl_lowprec import estimate_memory
    from pl_lowprec.memory.devices import device_spec, gpu_named
    from pl_lowprec.memory.step_time import predict_step_time

    measured = json.loads(Path(args.calibration).read_text())
    gpu = gpu_named(measured["device"])
    spec = device_spec(gpu)
    print(f"{measured['device']} (torch {measured['torch']}), against the table's {spec.name}:")
    print(
        f"  bf16 matmul {measured['matmul_bf16_flops'] / 1e12:.0f} TFLOP/s ="
        f" {measured['matmul_bf16_flops'] / spec.flops['bf16']:.2f} of the peak (MATMUL_EFFICIENCY"
        f" {spec.matmul_efficiency}); fp32 {measured['matmul_fp32_flops'] / 1e12:.1f} TFLOP/s ="
        f" {measured['matmul_fp32_flops'] / spec.flops['fp32']:.2f}; copy {measured['copy_bandwidth'] / 1e12:.2f}"
        f" TB/s = {measured['copy_bandwidth'] / spec.bandwidth:.2f} of the bandwidth (MEMORY_EFFICIENCY"
        f" {spec.memory_efficiency}); {measured['host_seconds_per_kernel'] * 1e6:.1f} us of host time per tiny"
        f" autograd kernel (LAUNCH_OVERHEAD {spec.launch_overhead * 1e6:.0f} us, with HF and peft modules)"
    )
    kernels_only = dataclasses.replace(spec, launch_overhead=0.0)
    print(
        "| model | measured step s | predicted s | predicted / measured | kernels (profiled) | kernels (predicted)"
        " | GPU busy s | predicted kernel s |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, figures in measured["steps"].items():
        width, blocks, heads, vocab, rows, seq = MODELS[name]
        estimate = estimate_memory(
            lambda w=width, b=blocks, h=heads, v=vocab: GPT(w, b, h, v),
            torch.randint(0, vocab, (rows, seq)),
            precision="bf16-mixed",
            time_on=gpu,
        )
        step, kernels = estimate.step_time, predict_step_time(estimate.ops, kernels_only)
        print(
            f"| {name} | {figures['step_seconds']:.4f} | {step.seconds:.4f} |"
            f" {step.seconds / figures['step_seconds']:.2f} | {figures.get('kernels', 0):,} | {step.launches:,} |"
            f" {figures.get('gpu_busy_seconds', float('nan')):.4f} | {kernels.seconds:.4f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    on_gpu = commands.add_parser("measure", help="on the GPU: time the device and the steps")
    on_gpu.add_argument("--out", default="calibration.json")
    on_gpu.add_argument("--steps", type=int, default=8)
    anywhere = commands.add_parser("compare", help="predict the same steps and print both")
    anywhere.add_argument("calibration")
    args = parser.parse_args()
    measure(args) if args.command == "measure" else compare(args)


if __name__ == "__main__":
    main()
