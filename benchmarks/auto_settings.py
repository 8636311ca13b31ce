"""What ``memory_saving: auto`` / ``activation_checkpointing: auto`` choose on this machine's device, against the
memory-saving settings the configs shipped before, in step time and peak memory.

Run: python benchmarks/auto_settings.py --shapes ../shared/model-shapes/llama-3.2-1b.json [--layers N]
     [--rows 2] [--seq 2048] [--steps 10]

A random bf16 model of the given shapes (``--layers`` fewer blocks) is written with ``save_pretrained`` and
fine-tuned through ``CausalLM(loss_chunk_size="auto")`` and ``LowPrecisionStrategy(quantization="nf4-dq")`` with
LoRA r=16, alpha 32 on every linear layer, bf16-mixed, one fresh process per contender:

- auto: both ``"auto"``: what ``fit`` takes for the device's free memory (its line is printed);
- exact paths: ``memory_saving: true`` (fused MLP, recomputed norms, cross-entropy in row groups, loss in chunks
  of 256), no checkpointing;
- memory-saving: ``memory_saving: true`` and every block checkpointed (the configs before ``auto``).

For each: the median time of steps 3 to the end (CUDA synchronized at each step's start), tokens per second,
the measured peak of the steps (``torch.cuda.max_memory_allocated`` from the start of training, and the loading's
before it, apart; on CPU the process's resident peak, which holds more than tensors) and the predicted one
(``estimate_memory`` of the settings that ran).
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CONTENDERS = {
    "auto": {"memory_saving": "auto", "activation_checkpointing": "auto"},
    "exact paths, no checkpointing": {"memory_saving": True},
    "memory-saving": {"memory_saving": True, "activation_checkpointing": ["LlamaDecoderLayer"]},
}
LORA = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": "all-linear"}


def save_model(shapes: Path, layers: int | None, directory: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(shapes))
    if layers:
        config.num_hidden_layers = layers
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)


def run_one(name: str, directory: str, rows: int, seq: int, steps: int) -> dict[str, Any]:
    """Fit ``steps`` steps with one contender's settings, in this process."""
    import lightning.pytorch as pl
    import torch

    from pl_lowprec import LowPrecisionStrategy, estimate_memory
    from pl_lowprec.memory.plan import fresh_copies
    from pl_lowprec.memory.process import memory_stats
    from pl_lowprec.models import CausalLM

    cuda = torch.cuda.is_available()
    stamps: list[float] = []

    loading: dict[str, int] = {}

    class Clock(pl.Callback):
        def on_train_start(self, *args: Any) -> None:
            """The peak so far is loading's (streaming and quantizing): the step's is measured from here."""
            if cuda:
                loading["peak"] = torch.cuda.max_memory_allocated()
                torch.cuda.reset_peak_memory_stats()

        def on_train_batch_start(self, *args: Any) -> None:
            if cuda:
                torch.cuda.synchronize()
            stamps.append(time.perf_counter())

        def on_train_end(self, *args: Any) -> None:
            self.on_train_batch_start()

    torch.manual_seed(0)
    vocab = CausalLM(directory).config.vocab_size
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, vocab, (rows * steps, seq))]
    module = CausalLM(directory, lr=1e-4, warmup_steps=1, loss_chunk_size="auto")
    strategy = LowPrecisionStrategy(quantization="nf4-dq", lora=LORA, **CONTENDERS[name])
    trainer = pl.Trainer(
        accelerator="cuda" if cuda else "cpu",
        devices=1,
        strategy=strategy,
        precision="bf16-mixed",
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Clock()],
    )
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=rows))
    measured = memory_stats(torch.device("cuda" if cuda else "cpu"))
    times = [b - a for a, b in itertools.pairwise(stamps)][2:]
    config = strategy.transform_config  # the settings that ran ("auto" chosen)
    batch = {"input_ids": data[0]["input_ids"].expand(rows, -1), "labels": data[0]["labels"].expand(rows, -1)}
    build = fresh_copies(CausalLM(directory, loss_chunk_size="auto"))
    predicted = estimate_memory(build, batch, precision="bf16-mixed", device="cuda" if cuda else "cpu", config=config)
    step = statistics.median(times)
    return {
        "contender": name,
        "settings": f"memory_saving={sorted(config.memory_saving)}, checkpointing={config.activation_checkpointing}",
        "step_s": step,
        "tokens_per_s": rows * seq / step,
        "measured_peak": measured.get("cuda_max_allocated", measured.get("rss_peak")),
        "predicted_peak": predicted.peak,
        "loading_peak": loading.get("peak"),
        "steps_s": times,
    }


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", type=Path, required=True, help="a config.json of the model's shapes")
    parser.add_argument("--layers", type=int, default=None, help="fewer blocks than the shapes have")
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--one", nargs=2, metavar=("CONTENDER", "DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one[0], args.one[1], args.rows, args.seq, args.steps)))
        return []
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(args.shapes, Path(tmp) / "config.json")
        save_model(Path(tmp), args.layers, Path(tmp))
        for name in CONTENDERS:
            command = [sys.executable, __file__, "--one", name, tmp, *_sizes(args)]
            done = subprocess.run(command, capture_output=True, text=True)
            chosen = [line for line in done.stderr.splitlines() if "Memory settings for" in line]
            print("\n".join(chosen), flush=True)
            if done.returncode != 0:
                print(done.stderr[-3000:], flush=True)
                continue
            results.append(json.loads(done.stdout.split("RESULT ", 1)[1].splitlines()[0]))
    gib = 2**30
    print("| contender | settings | step s | tokens/s | measured peak GiB | predicted GiB | error | loading peak GiB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        error = r["predicted_peak"] / r["measured_peak"] - 1
        print(
            f"| {r['contender']} | {r['settings']} | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} |"
            f" {r['measured_peak'] / gib:.2f} | {r['predicted_peak'] / gib:.2f} | {error:+.1%} |"
            f" {(r['loading_peak'] or 0) / gib:.2f} |"
        )
    return results


def _sizes(args: argparse.Namespace) -> list[str]:
    return ["--shapes", str(args.shapes), "--rows", str(args.rows), "--seq", str(args.seq), "--steps", str(args.steps)]


if __name__ == "__main__":
    main()
