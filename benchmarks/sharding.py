"""Single device, DDP and FSDP side by side on the same QLoRA model: per-rank parameter bytes, peak memory, step time.

python benchmarks/sharding.py [--hidden 256] [--layers 4] [--steps 12] [--rounds 2]

Each run is a fresh process group (1 or 2 CPU processes, gloo) training the same TinyLlama with nf4-dq base
weights and LoRA r=8 under AMPPrecision("auto"), the same global batch, and prints one JSON line per rank;
runs alternate (single, DDP, FSDP, single, ...) and step times are medians. Single and DDP store the base with
bitsandbytes (every rank holds all of it); FSDP stores it as torchao NF4 and each rank holds half. "params" is
what this rank holds of every parameter (4-bit data and constants included); "peak RSS" is the process's
high-water mark (torch and Python included, so at this size it is dominated by the runtime). No figure is
asserted anywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = {"single": 1, "ddp": 2, "fsdp": 2}


def held_bytes(module) -> int:
    """Bytes of parameter storage this rank holds: local shards, NF4 inner tensors, bitsandbytes constants."""
    from pl_lowprec.transforms.nf4 import is_nf4, local, nf4_bytes

    total = 0
    for param in module.parameters():
        if is_nf4(param):
            total += nf4_bytes(param)
            continue
        held = local(param)
        total += held.numel() * held.element_size()
        state = getattr(param, "quant_state", None)
        if state is not None:
            total += sum(t.numel() * t.element_size() for t in _state_tensors(state))
    return total


def _state_tensors(state) -> list:
    """A bitsandbytes quant state's per-layer constants (the shared code tables are not counted)."""
    import torch

    tensors = [state.absmax, getattr(state, "offset", None)]
    if getattr(state, "state2", None) is not None:
        tensors.append(state.state2.absmax)
    return [t for t in tensors if isinstance(t, torch.Tensor)]


def worker(kind: str, hidden: int, layers: int, steps: int) -> None:
    import warnings

    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, DistributedSampler

    from pl_lowprec import AMPPrecision
    from pl_lowprec.demo import TinyLlama
    from pl_lowprec.memory.process import reset_peak

    warnings.filterwarnings("ignore")
    from pl_lowprec import LowPrecisionDDPStrategy, LowPrecisionFSDPStrategy, LowPrecisionStrategy

    world = RUNS[kind]
    strategy_class = {"single": LowPrecisionStrategy, "ddp": LowPrecisionDDPStrategy, "fsdp": LowPrecisionFSDPStrategy}
    strategy = strategy_class[kind](
        quantization="nf4-dq", lora={"r": 8, "lora_alpha": 16}, activation_checkpointing=["LlamaDecoderLayer"]
    )
    global_batch, seq = 8, 128
    ids = torch.randint(0, 256, (global_batch * steps, seq), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": row} for row in ids]
    rank = int(os.environ.get("LOCAL_RANK", 0))
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False) if world > 1 else None
    times: list[float] = []

    class Timer(pl.Callback):
        def on_train_batch_start(self, *args):
            self.start = time.perf_counter()

        def on_train_batch_end(self, *args):
            times.append(time.perf_counter() - self.start)

        def on_train_start(self, trainer, module):
            self.params = held_bytes(module)

    timer = Timer()
    model = TinyLlama(hidden_size=hidden, intermediate_size=2 * hidden, num_layers=layers, max_len=seq)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        plugins=[AMPPrecision("auto")],
        max_steps=steps,
        use_distributed_sampler=False,
        logger=False,
        callbacks=[timer],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    reset_peak(torch.device("cpu"))
    trainer.fit(model, DataLoader(data, batch_size=global_batch // world, sampler=sampler))
    peak = int(Path("/proc/self/status").read_text().split("VmHWM:")[1].split()[0]) * 1024
    result = {"run": kind, "rank": trainer.global_rank, "params": timer.params, "peak_rss": peak, "times": times}
    print("RESULT " + json.dumps(result), flush=True)


def launch(kind: str, args: argparse.Namespace) -> list[dict]:
    command = [sys.executable, __file__, "--worker", kind, "--hidden", str(args.hidden), "--layers", str(args.layers)]
    command += ["--steps", str(args.steps)]
    out = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    results = [json.loads(line[7:]) for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode or not results:
        raise RuntimeError(f"{kind} failed:\n{out.stderr[-3000:]}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--worker")
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.hidden, args.layers, args.steps)
        return
    samples: dict[str, list[list[dict]]] = {kind: [] for kind in RUNS}
    for _ in range(args.rounds):
        for kind in RUNS:
            samples[kind].append(launch(kind, args))
    import torch

    print(f"TinyLlama hidden {args.hidden}, {args.layers} layers, nf4-dq + LoRA r=8, global batch 8 x 128, CPU")
    print(f"torch {torch.__version__}, {os.cpu_count()} CPU cores; step time: median of steps 3.. over {args.rounds}")
    print("| run | ranks | params per rank MiB | params ratio to single | peak RSS per rank MiB | step s |")
    print("|---|---|---|---|---|---|")
    single_params = samples["single"][0][0]["params"]
    for kind, rounds in samples.items():
        ranks = rounds[0]
        params = max(r["params"] for r in ranks)
        peak = max(max(r["peak_rss"] for r in run) for run in rounds)
        step = statistics.median(t for run in rounds for r in run if r["rank"] == 0 for t in r["times"][2:])
        print(
            f"| {kind} | {len(ranks)} | {params / 2**20:.2f} | {params / single_params:.3f} |"
            f" {peak / 2**20:.0f} | {step:.3f} |"
        )


if __name__ == "__main__":
    main()
