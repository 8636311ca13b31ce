"""Predicted peak (``estimate_memory``) against the measured peak (profiler allocation records), one process each.

TinyLlama (hidden 256, 4 layers, 4 heads, MLP 688, vocab 256), batch 8 x 256, torch AdamW unless named.
The measured run applies the strategy's own ``ModelTransform`` to a real model and runs Lightning's step loop
(``pl_lowprec.memory.fake_step.run_step``, the same loop the estimate runs on fake tensors); step 2 is measured.

    python benchmarks/peak_memory.py            # every configuration
    python benchmarks/peak_memory.py --one NAME # one, in this process (what the table runs per configuration)
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

MiB = 2**20
CONFIGS = {
    "full fp32": ("32-true", {}),
    "full fp32 ckpt": ("32-true", {"activation_checkpointing": ["LlamaDecoderLayer"]}),
    "lora fp32": ("32-true", {"lora": {"r": 8}}),
    "lora fp32 ckpt": ("32-true", {"lora": {"r": 8}, "activation_checkpointing": ["LlamaDecoderLayer"]}),
    "qlora fp32": ("32-true", {"quantization": "nf4-dq", "lora": {"r": 8}}),
    "qlora fp32 ckpt": (
        "32-true",
        {"quantization": "nf4-dq", "lora": {"r": 8}, "activation_checkpointing": ["LlamaDecoderLayer"]},
    ),
    "full bf16-mixed": ("bf16-mixed", {}),
    "lora bf16-mixed ckpt": ("bf16-mixed", {"lora": {"r": 8}, "activation_checkpointing": ["LlamaDecoderLayer"]}),
    "qlora bf16-mixed ckpt": (
        "bf16-mixed",
        {"quantization": "nf4-dq", "lora": {"r": 8}, "activation_checkpointing": ["LlamaDecoderLayer"]},
    ),
    "qlora fp32 ckpt, accumulation 2": (
        "32-true",
        {
            "quantization": "nf4-dq",
            "lora": {"r": 8},
            "activation_checkpointing": ["LlamaDecoderLayer"],
            "accumulate": 2,
        },
    ),
    "qlora fp32 ckpt, adamw8bit": (
        "32-true",
        {
            "quantization": "nf4-dq",
            "lora": {"r": 8},
            "activation_checkpointing": ["LlamaDecoderLayer"],
            "optimizer": "adamw8bit",
        },
    ),
}


def build(hidden: int = 256, layers: int = 4, max_len: int = 256):
    from pl_lowprec.demo import TinyLlama

    return functools.partial(
        TinyLlama,
        hidden_size=hidden,
        intermediate_size=688 if hidden == 256 else 2 * hidden,
        num_layers=layers,
        num_heads=4,
        max_len=max_len,
    )


def measure(precision: str, settings: dict, batch_size: int = 8, seq_len: int = 256, **model: int) -> int:
    """The profiler's peak of step 2 for ``settings`` (the strategies' model arguments, and ``accumulate``), in
    this process (run it in a fresh one); ``model``: ``build``'s."""
    warnings.filterwarnings("ignore")
    import torch

    from pl_lowprec.memory.estimate import _Precision
    from pl_lowprec.memory.fake_step import DryRunTrainer, attached, run_step
    from pl_lowprec.memory.profiled import measured_peak
    from pl_lowprec.transforms.config import TransformConfig
    from pl_lowprec.transforms.dtypes import dtype_of_precision
    from pl_lowprec.transforms.pipeline import ModelTransform

    settings = dict(settings)
    accumulate = settings.pop("accumulate", 1)
    batch = {"input_ids": torch.randint(0, 256, (batch_size, seq_len))}
    torch.manual_seed(0)
    module = build(**model, max_len=seq_len)()
    transform = ModelTransform(TransformConfig(**settings))
    transform.apply(module, _Precision(precision), torch.device("cpu"))
    trainable = [p for p in module.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4)
    optimizer = transform.swap_optimizers([optimizer], [], torch.device("cpu"))[0]
    autocast = dtype_of_precision(precision) if precision.endswith("-mixed") else None
    trainer = DryRunTrainer(transform, accumulate)

    def step() -> None:
        run_step(module, batch, optimizer, untracked_phases(), autocast, accumulate)

    with attached(module, trainer):
        return measured_peak(step, before=step)  # step 1 makes the optimizer state and the gradients step 2 frees


def measure_and_predict(name: str, batch_size: int = 8, seq_len: int = 256, **model: int) -> dict:
    """Both figures for one configuration, in this process (run it in a fresh one); ``model``: ``build``'s."""
    from pl_lowprec import estimate_memory

    precision, settings = CONFIGS[name]
    measured = measure(precision, settings, batch_size, seq_len, **model)
    import torch

    settings = dict(settings)
    accumulate = settings.pop("accumulate", 1)
    batch = {"input_ids": torch.randint(0, 256, (batch_size, seq_len))}
    started = time.perf_counter()
    estimate = estimate_memory(
        build(**model, max_len=seq_len), batch, precision=precision, accumulate_grad_batches=accumulate, **settings
    )
    seconds = time.perf_counter() - started

    return {
        "config": name,
        "measured": measured,
        "predicted": estimate.peak,
        "error": (estimate.peak - measured) / measured,
        "peak_phase": estimate.peak_phase,
        "estimate_s": seconds,
    }


def measure_in_fresh_process(precision: str, settings: dict, run: Callable = subprocess.run, **sizes: int) -> int:
    """``measure`` in a process of its own: the measured peak of any settings (``plan``'s tests use it, with a
    ``run`` that starts the process already importing torch: tests/warm_python.py)."""
    request = json.dumps({"precision": precision, "settings": settings, "sizes": sizes})
    done = run(
        [sys.executable, __file__, "--measure", request], capture_output=True, text=True, cwd=Path(__file__).parents[1]
    )
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return int(done.stdout.strip().splitlines()[-1])


FSDP_NAME = "fsdp qlora fp32 ckpt, 2 ranks (per rank)"
FSDP_SETTINGS = {"quantization": "nf4", "lora": {"r": 8}, "activation_checkpointing": ["LlamaDecoderLayer"]}


def _fsdp_rank(rank: int, world: int, sizes: dict, port: int) -> None:
    """One rank of the real 2-process gloo run: the strategy's transform with its Sharding, then step 2 measured."""
    import os

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from pl_lowprec.distributed.sharding import Sharding
    from pl_lowprec.memory.estimate import _Precision
    from pl_lowprec.memory.fake_step import DryRunTrainer, attached, run_step
    from pl_lowprec.memory.profiled import measured_peak
    from pl_lowprec.transforms.config import TransformConfig
    from pl_lowprec.transforms.nf4 import NF4Layout
    from pl_lowprec.transforms.pipeline import ModelTransform

    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    batch_size, seq_len = sizes.pop("batch_size", 8), sizes.pop("seq_len", 256)
    torch.manual_seed(0)
    module = build(**sizes, max_len=seq_len)()
    sharding = Sharding(units=["LlamaDecoderLayer"], layout=NF4Layout(), mesh=init_device_mesh("cpu", (world,)))
    transform = ModelTransform(TransformConfig(**FSDP_SETTINGS), sharding)
    transform.apply(module, _Precision("32-true"), torch.device("cpu"))
    optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=1e-4)
    batch = {"input_ids": torch.randint(0, 256, (batch_size, seq_len))}
    with attached(module, DryRunTrainer(transform, 1, world)):

        def step() -> None:
            run_step(module, batch, optimizer, untracked_phases(), None)

        peak = measured_peak(step, before=step)  # step 1 makes the state and the gradients step 2 frees
    print(json.dumps({"rank": rank, "measured": peak}), flush=True)
    dist.destroy_process_group()


def untracked_phases():
    """What ``run_step`` takes as its tracker when only the real step runs: phase markers, nothing tracked."""
    import contextlib

    class Phases:
        def phase(self, name):
            return contextlib.nullcontext()

    return Phases()


def fsdp_measure_and_predict(**sizes: int) -> dict:
    """The real 2-rank run (its ranks' peaks) against the per-rank estimate."""
    import torch
    import torch.multiprocessing as mp

    from pl_lowprec import estimate_memory
    from pl_lowprec.distributed.sharding import Sharding
    from pl_lowprec.transforms.nf4 import NF4Layout

    warnings.filterwarnings("ignore")
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    # The ranks are forked before anything is simulated here: each starts from this process as a fresh one holds
    # it, less the second import of torch a spawned rank paid (about 6 s of CPU each). The estimate is timed after
    # they end, alone.
    port = find_free_network_port()
    mp.start_processes(_fsdp_rank, args=(2, dict(sizes), port), nprocs=2, start_method="fork")
    batch_size, seq_len = sizes.get("batch_size", 8), sizes.get("seq_len", 256)
    model = {k: v for k, v in sizes.items() if k not in ("batch_size", "seq_len")}
    started = time.perf_counter()
    estimate = estimate_memory(
        build(**model, max_len=seq_len),
        {"input_ids": torch.zeros(batch_size, seq_len, dtype=torch.long)},
        sharding=Sharding(units=["LlamaDecoderLayer"], layout=NF4Layout()),
        world_size=2,
        **FSDP_SETTINGS,
    )
    seconds = time.perf_counter() - started
    return {"config": FSDP_NAME, "predicted": estimate.peak, "peak_phase": estimate.peak_phase, "estimate_s": seconds}


def run_one_process(name: str, run: Callable = subprocess.run, **sizes: int) -> dict:
    """``measure_and_predict`` in a fresh process (the profiler's base must not see earlier runs); ``run`` as for
    ``measure_in_fresh_process``."""
    done = run(
        [sys.executable, __file__, "--one", name, "--sizes", json.dumps(sizes)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parents[1],
    )
    if done.returncode != 0:
        raise RuntimeError(f"{name}: {done.stderr[-3000:]}")
    lines = [json.loads(found) for found in re.findall(r"\{[^{}]*\}", done.stdout)]  # ranks may share a line
    row = lines[-1]
    ranks = [line["measured"] for line in lines if "rank" in line]
    if ranks:  # FSDP: every rank holds the same shapes; the table shows the largest rank
        row["measured"], row["ranks"] = max(ranks), ranks
    row["error"] = (row["predicted"] - row["measured"]) / row["measured"]
    return row


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--one", choices=[*CONFIGS, FSDP_NAME])
    parser.add_argument("--sizes", default="{}", help='JSON: {"hidden": 64, "layers": 2, "batch_size": 2, ...}')
    parser.add_argument("--measure", help='JSON: {"precision": ..., "settings": {...}, "sizes": {...}}')
    args = parser.parse_args(argv)
    if args.measure:
        request = json.loads(args.measure)
        print(measure(request["precision"], request["settings"], **request["sizes"]))
        return {}
    if args.one == FSDP_NAME:
        print(json.dumps(fsdp_measure_and_predict(**json.loads(args.sizes))))
        return {}
    if args.one:
        print(json.dumps(measure_and_predict(args.one, **json.loads(args.sizes))))
        return {}
    print("| configuration | measured MiB | predicted MiB | error | peak in | estimate took |")
    print("|---|---|---|---|---|---|")
    rows = {}
    for name in [*CONFIGS, FSDP_NAME]:
        row = rows[name] = run_one_process(name)
        print(
            f"| {name} | {row['measured'] / MiB:.2f} | {row['predicted'] / MiB:.2f} | {row['error']:+.2%} |"
            f" {row['peak_phase']} | {row['estimate_s']:.1f} s |",
            flush=True,
        )
    return rows


if __name__ == "__main__":
    main()
