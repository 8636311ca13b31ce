"""Every comparison, side by side, on the machine it runs on (CPU here; CUDA where present, same scripts).

Run: python benchmarks/run_all.py        (about 8 minutes on a 2-core CPU; tables on stdout, JSON in
                                           benchmarks/results/)

1. overhead: Trainer + AMPPrecision vs Lightning's "bf16-mixed" vs the plain loop (interleaved rounds)
2. qlora memory: bytes/parameter per mode; full / LoRA / QLoRA x checkpointing on a ~26M TinyLlama, each in a
   fresh process (its own peak RSS), with estimate_memory's prediction error per component
3. activation checkpointing: activation bytes saved and the step-time cost (from 2)
4. against HF: transformers Trainer + peft vs pl_lowprec, same model/data/LoRA/precision, interleaved
5. callbacks: LossScaleMonitor and MemoryTracker overhead
6. quality: validation perplexity after a fixed number of steps (reported, never asserted)
7. k-bit preparation memory vs peft, and adapter-only checkpoint size
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import callback_overhead
import checkpoint_size
import kbit_prep_memory
import lightning.pytorch as pl
import torch
from common import StepTimer, interleaved, machine, markdown_table, write_json

from pl_lowprec import AMPPrecision, LowPrecisionStrategy, estimate_memory
from pl_lowprec.demo import StdlibTextDataModule, TinyGPT, TinyLlama
from pl_lowprec.memory.breakdown import parameter_bytes
from pl_lowprec.quantization import QUANT_MODES, QuantizationConfig, quantize_model

HERE = Path(__file__).resolve().parent


def section(title: str) -> None:
    print(f"\n## {title}\n", flush=True)


def quiet(**kwargs) -> pl.Trainer:
    return pl.Trainer(
        accelerator="auto",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kwargs,
    )


# 1 -------------------------------------------------------------------------------------------------------
def overhead(rounds: int = 3, steps: int = 12) -> dict:
    ids = torch.randint(0, 256, (steps * 8, 129), generator=torch.Generator().manual_seed(0))
    loader = torch.utils.data.DataLoader([{"input_ids": r} for r in ids], batch_size=8)

    def lightning(plugins, precision=None):
        timer = StepTimer()
        torch.manual_seed(0)
        kwargs = {"precision": precision} if precision else {}
        quiet(max_steps=steps, plugins=plugins, callbacks=[timer], **kwargs).fit(TinyGPT(), loader)
        return timer.times

    def plain():
        torch.manual_seed(0)
        model = TinyGPT()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        times = []
        for batch in loader:
            start = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model._loss(batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
        return times

    medians = interleaved(
        {
            "Trainer + AMPPrecision('bf16-mixed')": lambda: lightning([AMPPrecision("bf16-mixed")]),
            "Trainer(precision='bf16-mixed')": lambda: lightning([], "bf16-mixed"),
            "plain loop (autocast bf16)": plain,
        },
        rounds,
    )
    base = medians["plain loop (autocast bf16)"]
    section("Overhead: steps per second (TinyGPT dim 64, batch 8 x 128, bf16 autocast)")
    print(
        markdown_table(
            ["contender", "steps/s", "ratio to plain loop"], [(n, 1 / t, base / t) for n, t in medians.items()]
        )
    )
    return {"median_step_s": medians}


# 2, 3 ----------------------------------------------------------------------------------------------------
def bytes_per_parameter() -> dict:
    result = {}
    for mode in QUANT_MODES:
        model = TinyLlama(hidden_size=512, intermediate_size=1408, num_layers=2, num_heads=8).model
        n = sum(
            m.weight.numel()
            for name, m in model.named_modules()
            if type(m) is torch.nn.Linear and "lm_head" not in name
        )
        quantize_model(model, QuantizationConfig.from_mode(mode), torch.bfloat16, torch.device("cpu"))
        if mode == "int8":
            model(input_ids=torch.zeros(1, 4, dtype=torch.long))  # bitsandbytes moves the scales on first use
        result[mode] = sum(v for k, v in parameter_bytes(model).items() if k.startswith("quantized")) / n
    section("Quantized weights: bytes per parameter, constants included (TinyLlama hidden 512)")
    print(markdown_table(["mode", "bytes/param"], list(result.items())))
    return result


def train_once(stack: str, mode: str, checkpointing: bool, steps: int = 6) -> dict:
    cmd = [sys.executable, str(HERE / "train_once.py"), "--stack", stack, "--mode", mode, "--steps", str(steps)]
    out = subprocess.run(
        cmd + (["--checkpointing"] if checkpointing else []), capture_output=True, text=True, check=True
    )
    line = next(line for line in out.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line.removeprefix("RESULT "))


def predicted(mode: str, checkpointing: bool) -> dict[str, int]:
    settings = {"lora": {"r": 8, "lora_alpha": 16}} if mode != "full" else {}
    if mode == "qlora":
        settings["quantization"] = "nf4-dq"
    if checkpointing:
        settings["activation_checkpointing"] = ["LlamaDecoderLayer"]
    build = lambda: TinyLlama(hidden_size=512, intermediate_size=1408, num_layers=8, num_heads=8, max_len=256)  # noqa: E731
    batch = {"input_ids": torch.zeros(8, 256, dtype=torch.long)}
    return estimate_memory(build, batch, precision="bf16-mixed", **settings).as_dict()


def qlora_memory() -> dict:
    runs = {}
    for mode in ("full", "lora", "qlora"):
        for ckpt in (False, True):
            runs[f"{mode}{' + ckpt' if ckpt else ''}"] = (mode, ckpt, train_once("lightning", mode, ckpt))
    section("Training memory, TinyLlama ~26M parameters (hidden 512, 8 layers), batch 8 x 256, bf16-mixed, CPU")
    rows = []
    for name, (_, _, r) in runs.items():
        b = r["breakdown"]
        weights = sum(v for k, v in b.items() if k.startswith("params_"))
        rows.append(
            (
                name,
                r["rss_peak"] / 2**20,
                weights / 2**20,
                b["gradients"] / 2**20,
                b["optimizer_state"] / 2**20,
                b["activations"] / 2**20,
                statistics.median(r["times"][2:]),
            )
        )
    print(
        markdown_table(
            ["run", "peak RSS MiB", "weights MiB", "grads MiB", "optimizer MiB", "activations MiB", "step s"], rows
        )
    )

    section("estimate_memory vs MemoryTracker: error per component (same runs)")
    errors = {}
    for name, (mode, ckpt, r) in runs.items():
        guess = predicted(mode, ckpt)
        measured = r["breakdown"]
        weights_m = sum(v for k, v in measured.items() if k.startswith("params_"))
        weights_p = sum(v for k, v in guess.items() if k.startswith("params_"))
        pairs = {"weights": (weights_p, weights_m)} | {
            k: (guess[k], measured[k]) for k in ("gradients", "optimizer_state", "activations")
        }
        errors[name] = {k: (p - m) / m if m else 0.0 for k, (p, m) in pairs.items()}
    print(
        markdown_table(
            ["run", "weights", "gradients", "optimizer_state", "activations"],
            [
                (n, *(f"{e[k]:+.1%}" for k in ("weights", "gradients", "optimizer_state", "activations")))
                for n, e in errors.items()
            ],
        )
    )

    section("Activation checkpointing: activation bytes saved and step-time cost (same runs)")
    ckpt_rows = []
    for mode in ("full", "lora", "qlora"):
        off, on = runs[mode][2], runs[f"{mode} + ckpt"][2]
        saved = 1 - on["breakdown"]["activations"] / off["breakdown"]["activations"]
        cost = statistics.median(on["times"][2:]) / statistics.median(off["times"][2:])
        ckpt_rows.append((mode, f"{saved:.0%}", cost))
    print(markdown_table(["run", "activation bytes saved", "step time ratio (on/off)"], ckpt_rows))
    return {"runs": {n: r for n, (_, _, r) in runs.items()}, "estimate_errors": errors, "checkpointing": ckpt_rows}


# 4 -------------------------------------------------------------------------------------------------------
def against_hf(rounds: int = 2) -> dict:
    results: dict[str, list[dict]] = {"transformers Trainer + peft": [], "pl_lowprec": []}
    for _ in range(rounds):
        results["transformers Trainer + peft"].append(train_once("hf", "qlora", False))
        results["pl_lowprec"].append(train_once("lightning", "qlora", False))
    summary = {}
    for name, runs in results.items():
        times = [t for r in runs for t in r["times"][2:]]
        summary[name] = {
            "step_s": statistics.median(times),
            "rss_peak": statistics.median(r["rss_peak"] for r in runs),
            "losses": runs[0]["losses"],
        }
    hf, ours = summary["transformers Trainer + peft"], summary["pl_lowprec"]
    gap = max(abs(a - b) for a, b in zip(hf["losses"], ours["losses"], strict=False))
    section("Against Hugging Face: QLoRA nf4-dq + LoRA r=8, bf16, same model, batches, seed (TinyLlama ~26M)")
    print(
        markdown_table(
            ["stack", "step s (median)", "peak RSS MiB", "step time ratio", "peak memory ratio"],
            [
                (n, s["step_s"], s["rss_peak"] / 2**20, s["step_s"] / hf["step_s"], s["rss_peak"] / hf["rss_peak"])
                for n, s in summary.items()
            ],
        )
    )
    print(f"\nLoss curves: largest per-step difference {gap:.2e} over {len(ours['losses'])} steps")
    return {"summary": summary, "max_loss_gap": gap}


# 6 -------------------------------------------------------------------------------------------------------
def quality(steps: int = 60) -> dict:
    setups = {
        "fp32 full": ([], {}, "32-true"),
        "bf16-mixed full": ([AMPPrecision("bf16-mixed")], {}, None),
        "fp16-mixed full": ([AMPPrecision("16-mixed", init_scale=1024.0)], {}, None),
        "LoRA bf16": ([AMPPrecision("bf16-mixed")], {"lora": {"r": 8, "lora_alpha": 16}}, None),
        "QLoRA nf4-dq bf16": (
            [AMPPrecision("bf16-mixed")],
            {"quantization": "nf4-dq", "lora": {"r": 8, "lora_alpha": 16}},
            None,
        ),
    }
    result = {}
    for name, (plugins, strategy, precision) in setups.items():
        torch.manual_seed(0)
        kwargs = {"precision": precision} if precision else {}
        trainer = quiet(
            max_steps=steps, limit_val_batches=8, plugins=plugins, strategy=LowPrecisionStrategy(**strategy), **kwargs
        )
        model = TinyLlama(hidden_size=128)
        data = StdlibTextDataModule(seq_len=128, batch_size=8)
        trainer.fit(model, data)
        result[name] = float(trainer.validate(model, data, verbose=False)[0]["val/perplexity"])
    section(f"Quality: validation perplexity after {steps} steps (TinyLlama hidden 128, stdlib text; reported only)")
    print(markdown_table(["setup", "val perplexity"], list(result.items())))
    return result


def main() -> None:
    started = time.time()
    print(f"# pl_lowprec benchmarks\n\nMachine: {machine()}")
    results = {
        "overhead": overhead(),
        "bytes_per_parameter": bytes_per_parameter(),
        "qlora_memory": qlora_memory(),
        "against_hf": against_hf(),
    }
    section("Callbacks")
    sys.argv = [sys.argv[0], "--rounds", "3"]
    results["callbacks"] = callback_overhead.main()
    results["quality"] = quality()
    section("k-bit preparation and checkpoint size")
    results["kbit_prep"] = kbit_prep_memory.main()
    results["checkpoint_size"] = checkpoint_size.main()
    path = write_json("all", results)
    print(f"\nWrote {path} in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
