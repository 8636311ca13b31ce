"""Training memory of full / LoRA / QLoRA fine-tunes, with and without activation checkpointing, each run in a
fresh process; ``estimate_memory``'s prediction against the measured peak of the same run.

Run: python benchmarks/run_all.py --only training_memory   (or python benchmarks/training_memory.py)

A TinyLlama (hidden 512, 4 layers, ~13M parameters), batch 4 x 256 bytes, 5 steps, fp32 (``32-true``: this
CPU computes bf16 several times slower than fp32; LoRA adapters and the 4-bit layers' compute are fp32 too).
Each configuration runs in its own process (``train_once.py --breakdown``), ``--rounds`` times in rotating
order. Measured peak: CPU, the peak resident set minus the resident set after the imports and before the
model was built; CUDA, ``max_memory_allocated`` minus what was allocated before the model was built. The
breakdown columns are ``MemoryTracker``'s exact counts.

On CPU the resident set also holds memory that glibc's allocator keeps after it was freed. To show how much,
each configuration runs once more, 2 steps, with ``MALLOC_MMAP_THRESHOLD_=131072 MALLOC_TRIM_THRESHOLD_=0``:
blocks of 128 KiB and more are then mapped and returned to the system as soon as they are freed (slower; not
used for timings).
Checkpointing step-time ratios pair step i of a run with step i of the same round's run without checkpointing
(the same batch); their median, interquartile range and min-max are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from common import device, extremes, markdown_table, quartiles, ratio, rounds, section, write_json
from train_once import AdamWLlama, model_kwargs

from pl_lowprec import estimate_memory

HERE = Path(__file__).resolve().parent
SHAPE = {"hidden": 512, "layers": 4, "batch": 4, "seq": 256, "steps": 5, "precision": "32-true"}
RETURN_FREED = {"MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "0"}
WARMUP = 2
CONFIGS = {
    f"{mode}{' + checkpointing' if ckpt else ''}": (mode, ckpt) for mode in ("full", "lora", "qlora") for ckpt in (0, 1)
}
MiB = 2**20


def train_once(stack: str, mode: str, checkpointing: bool, *extra: str, env: dict | None = None) -> dict[str, Any]:
    """One run of ``train_once.py`` in a fresh process; its RESULT line. ``extra`` overrides ``SHAPE``."""
    cmd = [sys.executable, str(HERE / "train_once.py"), "--stack", stack, "--mode", mode]
    cmd += [f"--{k}={v}" for k, v in SHAPE.items()] + (["--checkpointing"] if checkpointing else []) + list(extra)
    out = subprocess.run(cmd, capture_output=True, text=True, env=os.environ | (env or {}))
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    line = next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def estimate(mode: str, checkpointing: bool) -> dict[str, int]:
    settings: dict[str, Any] = {}
    if mode != "full":
        settings["lora"] = {"r": 8, "lora_alpha": 16, "lora_dropout": 0.0, "target_modules": "all-linear"}
    if mode == "qlora":
        settings["quantization"] = "nf4-dq"
    if checkpointing:
        settings["activation_checkpointing"] = ["LlamaDecoderLayer"]
    kwargs = model_kwargs(SHAPE["hidden"], SHAPE["layers"], SHAPE["seq"])
    batch = {"input_ids": torch.zeros(SHAPE["batch"], SHAPE["seq"], dtype=torch.long)}
    return estimate_memory(lambda: AdamWLlama(**kwargs), batch, precision=SHAPE["precision"], **settings).as_dict()


def _weights(figures: dict[str, int]) -> int:
    return sum(v for k, v in figures.items() if k.startswith("params_"))


def _timed(run: dict[str, Any]) -> list[float]:
    return run["times"][WARMUP:]


def _vs_tracker(guess: dict[str, int], tracked: dict[str, int]) -> dict[str, float]:
    parts = {"weights": (_weights(guess), _weights(tracked))}
    parts |= {k: (guess[k], tracked[k]) for k in ("gradients", "optimizer_state", "activations")}
    return {k: (p - m) / m if m else 0.0 for k, (p, m) in parts.items()}


def _describe_vs_tracker(errors: dict[str, float]) -> str:
    exact = [k for k in ("weights", "gradients", "optimizer_state") if errors[k] == 0]
    rest = [f"{k} {v:+.1%}" for k, v in errors.items() if k not in exact]
    return ", ".join(([f"{', '.join(exact)} exact"] if exact else []) + rest)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    cpu = device().type == "cpu"
    contenders = {
        name: (lambda m=m, c=c: train_once("lightning", m, c, "--breakdown")) for name, (m, c) in CONFIGS.items()
    }
    runs = rounds(contenders, args.rounds)
    returned = {}
    if cpu:
        returned = {
            name: train_once("lightning", m, c, "--breakdown", "--steps=2", env=RETURN_FREED)
            for name, (m, c) in CONFIGS.items()
        }
    where = "peak RSS" if cpu else "CUDA max_memory_allocated"

    section(
        f"Training memory, TinyLlama hidden {SHAPE['hidden']}, {SHAPE['layers']} layers, batch {SHAPE['batch']} x "
        f"{SHAPE['seq']}, {SHAPE['precision']}, {device().type.upper()}, one process per run, {args.rounds} runs each"
    )
    rows = []
    for name, rs in runs.items():
        b = rs[0]["breakdown"]  # exact counts: the same in every run
        parts = (_weights(b), b["gradients"], b["optimizer_state"], b["activations"])
        peaks = [r["measured_peak"] / MiB for r in rs]
        step = statistics.median(t for r in rs for t in _timed(r))
        peak = f"{statistics.median(peaks):.0f} ({min(peaks):.0f}-{max(peaks):.0f})"
        rows.append((name, peak, *(p / MiB for p in parts), step))
    headers = ["run", f"{where} MiB above baseline, median (min-max)", "weights MiB", "grads MiB", "optimizer MiB"]
    print(markdown_table([*headers, "activations MiB", "step s (median)"], rows))

    section(f"estimate_memory's total against the measured peak ({where} above the baseline), same runs")
    estimates, rows = {}, []
    for name, (mode, ckpt) in CONFIGS.items():
        guess = estimate(mode, bool(ckpt))
        measured = statistics.median(r["measured_peak"] for r in runs[name])
        entry = {
            "estimate": guess,
            "measured_peak": measured,
            "error": (guess["total"] - measured) / measured,
            "vs_memory_tracker": _vs_tracker(guess, runs[name][0]["breakdown"]),
        }
        row = [name, guess["total"] / MiB, measured / MiB, f"{entry['error']:+.0%}"]
        if cpu:
            entry["measured_peak_freed_returned"] = back = returned[name]["measured_peak"]
            entry["error_freed_returned"] = (guess["total"] - back) / back
            row += [back / MiB, f"{entry['error_freed_returned']:+.0%}"]
        estimates[name] = entry
        rows.append((*row, _describe_vs_tracker(entry["vs_memory_tracker"])))
    headers = ["run", "estimate MiB", "measured MiB (median)", "error"]
    if cpu:
        headers += ["measured MiB, freed blocks returned", "error"]
    print(markdown_table([*headers, "estimate vs MemoryTracker's count"], rows))

    section("Activation checkpointing: activation bytes saved and step-time cost (same runs)")
    ckpt, rows = {}, []
    for mode in ("full", "lora", "qlora"):
        off, on = runs[mode], runs[f"{mode} + checkpointing"]
        saved = 1 - on[0]["breakdown"]["activations"] / off[0]["breakdown"]["activations"]
        paired = ratio([t for r in on for t in _timed(r)], [t for r in off for t in _timed(r)])
        ckpt[mode] = {"activation_bytes_saved": saved, "step_time_ratio": paired}
        rows.append((mode, f"{saved:.0%}", f"{paired['median']:.2f}", quartiles(paired), extremes(paired)))
    headers = ["run", "activation bytes saved", "step time ratio on/off (median)", "interquartile range", "min-max"]
    print(markdown_table(headers, rows))
    result = {"shape": SHAPE, "runs": runs, "freed_returned_runs": returned, "estimate": estimates}
    write_json("training_memory", result | {"checkpointing": ckpt})
    return result | {"checkpointing": ckpt}


if __name__ == "__main__":
    main()
