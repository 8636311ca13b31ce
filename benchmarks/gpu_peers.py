"""QLoRA step time and peak memory against Hugging Face's recipe on one GPU: Llama-3.2-1B and Llama-3.1-8B shapes.

Run (a lent GPU; every default contender at both models, about 9 minutes): python benchmarks/gpu_peers.py
CPU check of the same code path (tiny shapes, a minute): python benchmarks/gpu_peers.py --models tiny
CPU proxy of the host's share of a 1B step (its 16 blocks, tiny widths; docs/benchmarks.md): python
benchmarks/gpu_peers.py --models host --contenders hf,auto,saving,compile --seq 128 --batch 2 --steps 12 --time-from 4

Each model is random bf16 weights written from its ``config.json`` (``model_shapes.py``) as sharded safetensors,
batch 2 x 2048 (``--batch``, ``--seq``), LoRA r=16 alpha 32 on every linear layer, nf4 with double quantization,
bf16-mixed, AdamW. Every contender is a fresh process (``train_once.py``), so its peak is its own:

- ``hf``: ``from_pretrained(BitsAndBytesConfig(nf4, double quant, bf16))`` + ``prepare_model_for_kbit_training``
  (gradient checkpointing) + ``get_peft_model(r=16, all-linear)`` + transformers' ``Trainer``;
- ``auto``: ``CausalLM`` + ``LowPrecisionStrategy`` with the shipped automatic choice (the fastest settings whose
  predicted peak fits the GPU's free memory);
- ``saving``: the memory-saving path (every block checkpointed, fused LoRA MLP, grouped cross-entropy, row-wise
  norms, loss in chunks of 256);
- ``auto-half``: the automatic choice with ``memory_budget=`` half of ``hf``'s measured peak on the same model (the
  issue's two targets at once: the fastest settings predicted to stay under 0.5x HF's peak); it runs after ``hf``;
- ``compile``: the memory-saving path with ``compile=True``;
- ``NAME+compile``: contender NAME with ``compile=True`` (``auto-half+compile``);
- ``unsloth``: Unsloth's ``FastLanguageModel`` with the same settings (``unsloth_once.py``), where it is installed
  (carried as wheels to the GPU machine; ``UNSLOTH_PYTHONPATH``, its own path, since it pins an older
  transformers).

Figures: the median step time of steps ``--time-from`` to the last (CUDA-synchronized), tokens/s, the peak
(``max_memory_allocated`` above the memory held after the imports), the predicted peak and step time where the
contender reports them, and each one's ratio to ``hf``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from model_shapes import SHAPES, SMALL_SHAPES

HERE = Path(__file__).resolve().parent
GiB = 2**30
MIN_CONTENDER_S = 20  # the fastest contender's wall time on a GPU (hf at 1B: 30 s, run 5)

# contender -> train_once.py arguments (besides the shared ones)
CONTENDERS: dict[str, list[str]] = {
    "hf": ["--stack", "hf", "--checkpointing"],
    "auto": [
        "--stack",
        "causal-lm",
        "--strategy-arg",
        "memory_saving=auto",
        "--strategy-arg",
        "activation_checkpointing=auto",
        "--loss-chunk-size",
        "-1",
    ],
    "saving": ["--stack", "causal-lm", "--checkpointing"],
    "auto-half": [],  # the "auto" arguments and a memory_budget from hf's row (run_contender)
    "compile": ["--stack", "causal-lm", "--checkpointing", "--strategy-arg", "compile=true"],
}


def write_random_checkpoint(config: dict[str, Any], directory: Path, shard_bytes: int = 4 * GiB) -> int:
    """Random bf16 weights of ``config``'s shapes (std 0.02, norms 1), written as safetensors shards with an index,
    generated on the GPU where there is one (an 8B model in seconds); returns the parameter count."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    hf_config = AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    tied = {"lm_head.weight"} if hf_config.tie_word_embeddings else set()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator(dev).manual_seed(0)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size, count = 0, 0
    for name, meta in model.state_dict().items():
        if name in tied:
            continue
        if name.endswith("norm.weight"):
            tensor = torch.ones(meta.shape, dtype=torch.bfloat16)
        else:
            tensor = (torch.randn(meta.shape, generator=generator, device=dev, dtype=torch.bfloat16) * 0.02).cpu()
        if size + tensor.nbytes > shard_bytes and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.nbytes
        count += tensor.numel()
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(directory / file), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(shard, file)
    total = sum(t.nbytes for shard in shards for t in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    hf_config.save_pretrained(directory)
    return count


def run_contender(
    name: str, args: argparse.Namespace, pretrained: Path, earlier: list[dict[str, Any]], deadline: float | None
) -> dict[str, Any]:
    """One contender in a fresh process, in the time ``--budget`` leaves it; its RESULT line, or the error it ended
    with."""
    timeout = args.timeout if deadline is None else min(args.timeout, int(deadline - time.monotonic()))
    if timeout < MIN_CONTENDER_S:
        return {"error": f"not run: {max(timeout, 0)} s of --budget {args.budget} left", "wall_s": 0.0}
    shared = ["--mode", "qlora", "--precision", args.precision, "--lora-r", str(args.r)]
    shared += ["--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps)]
    shared += ["--pretrained", str(pretrained), "--predict"] + ["--profile-step"] * args.profile_step
    if name == "unsloth":
        return run_unsloth(args, pretrained, timeout)
    base, _, compiled = name.partition("+")  # "auto-half+compile": that contender with compile=True
    own = CONTENDERS[base] + (["--strategy-arg", "compile=true"] if compiled == "compile" else [])
    if base == "auto-half":
        hf = next((r for r in earlier if r["contender"] == "hf" and "error" not in r), None)
        if hf is None:
            return {"error": "auto-half needs a measured hf row before it (--contenders hf,...,auto-half)"}
        own += [*CONTENDERS["auto"], "--strategy-arg", f"memory_budget={int(hf['peak_gib'] * GiB / 2)}"]
    return run_script([sys.executable, str(HERE / "train_once.py"), *own, *shared], timeout)


def run_unsloth(args: argparse.Namespace, pretrained: Path, timeout: int) -> dict[str, Any]:
    """Unsloth's QLoRA (``unsloth_once.py``) with the same settings, on its own ``PYTHONPATH`` where one is given
    (``UNSLOTH_PYTHONPATH``: Unsloth pins an older transformers than the other contenders')."""
    command = [sys.executable, str(HERE / "unsloth_once.py"), "--pretrained", str(pretrained)]
    command += ["--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps), "--lora-r", str(args.r)]
    path = os.environ.get("UNSLOTH_PYTHONPATH")
    return run_script(command, timeout, os.environ | {"PYTHONPATH": path} if path else None)


def run_script(command: list[str], timeout: int, env: dict[str, str] | None = None) -> dict[str, Any]:
    """A contender's process; its RESULT line, or the error it ended with."""
    started = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"over --timeout {timeout} s", "wall_s": time.perf_counter() - started}
    seconds = time.perf_counter() - started
    line = next((x for x in reversed(done.stdout.splitlines()) if x.startswith("RESULT ")), None)
    if done.returncode != 0 or line is None:
        return {"error": (done.stderr or done.stdout)[-3000:], "wall_s": seconds}
    return json.loads(line.removeprefix("RESULT ")) | {"wall_s": seconds}


def summarize(name: str, result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    if "error" in result:
        lines = result["error"].strip().splitlines()
        return {"contender": name, "error": lines[-1][:200], "error_tail": "\n".join(lines[-40:])}
    timed = result["times"][args.time_from - 1 :]
    step = statistics.median(timed)
    return {
        "contender": name,
        "step_s": step,
        "step_min_s": min(timed),
        "step_max_s": max(timed),
        "tokens_per_s": args.batch * args.seq / step,
        "peak_gib": result["measured_peak"] / GiB,
        "predicted_peak_gib": result["predicted_peak"] / GiB if result.get("predicted_peak") else None,
        "predicted_step_s": result.get("predicted_step_s"),
        "chosen": result.get("chosen"),
        "first_loss": result["losses"][0] if result["losses"] else None,
        "all_steps_s": [round(t, 4) for t in result["times"]],
        "step_profile": result.get("step_profile"),
        "host": result.get("host"),
        "ops": result.get("ops"),
        "ops_compiled": result.get("ops_compiled"),
        "wall_s": result["wall_s"],
    }


def table(rows: list[dict[str, Any]]) -> str:
    hf = next((r for r in rows if r["contender"] == "hf" and "error" not in r), None)
    lines = [
        "| contender | step s (min-max) | tokens/s | x HF step | peak GiB | x HF peak | predicted GiB"
        " | predicted step s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['contender']} | failed: {r['error']} |||||||")
            continue
        step_ratio = f"{r['step_s'] / hf['step_s']:.2f}x" if hf else "-"
        peak_ratio = f"{r['peak_gib'] / hf['peak_gib']:.2f}x" if hf else "-"
        predicted = f"{r['predicted_peak_gib']:.2f}" if r["predicted_peak_gib"] is not None else "-"
        predicted_step = f"{r['predicted_step_s']:.3f}" if r["predicted_step_s"] is not None else "-"
        lines.append(
            f"| {r['contender']} | {r['step_s']:.3f} ({r['step_min_s']:.3f}-{r['step_max_s']:.3f}) |"
            f" {r['tokens_per_s']:,.0f} | {step_ratio} | {r['peak_gib']:.2f} | {peak_ratio} | {predicted} |"
            f" {predicted_step} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--models", default="1b,8b", help="comma-separated: 1b, 8b, qwen-0.5b, mistral-7b (model_shapes.py), tiny, host"
    )
    parser.add_argument("--contenders", default="hf,auto,saving,compile,unsloth")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--r", type=int, default=16)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--time-from", type=int, default=3, help="first timed step (1-based)")
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per contender")
    parser.add_argument(
        "--budget",
        type=int,
        help="seconds for the whole run: each contender's --timeout shrinks to what is left, and one that cannot"
        " start is a failed row, so a run cut short still prints its table",
    )
    parser.add_argument("--profile-step", action="store_true", help="one more step, profiled (train_once.py)")
    parser.add_argument("--keep-models", help="write each model's checkpoint under this folder, and reuse it there")
    parser.add_argument("--out", default=os.environ.get("OUT") or str(HERE / "results"))
    args = parser.parse_args(argv)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU (CPU check)"
    print(f"# gpu_peers on {gpu}, torch {torch.__version__}; {time.strftime('%Y-%m-%d %H:%M')}", flush=True)
    if "unsloth" not in args.contenders.split(","):
        print("Unsloth: not run (--contenders unsloth runs it where it is installed).", flush=True)
    rows: list[dict[str, Any]] = []
    deadline = time.monotonic() + args.budget if args.budget else None
    for model in args.models.split(","):
        config = SMALL_SHAPES.get(model) or SHAPES[model]
        with tempfile.TemporaryDirectory() as scratch:
            directory = Path(args.keep_models, model) if args.keep_models else Path(scratch)
            started = time.perf_counter()
            if (directory / "model.safetensors.index.json").exists():
                params = 0
            else:
                directory.mkdir(parents=True, exist_ok=True)
                params = write_random_checkpoint(config, directory)
            print(f"\n## {model}: {params / 1e9:.2f}B parameters, written in {time.perf_counter() - started:.0f} s")
            model_rows = []
            for name in args.contenders.split(","):
                result = run_contender(name, args, directory, model_rows, deadline)
                row = summarize(name, result, args) | {"model": model}
                model_rows.append(row)
                print(f"{name}: {json.dumps({k: v for k, v in row.items() if k != 'ops'})}", flush=True)
                write_rows(args, gpu, rows + model_rows)  # after each one: a run cut short keeps what it measured
            print(table(model_rows), flush=True)
            rows += model_rows
    return rows


def write_rows(args: argparse.Namespace, gpu: str, rows: list[dict[str, Any]]) -> None:
    Path(args.out).mkdir(parents=True, exist_ok=True)
    name = f"gpu_peers-{args.models.replace(',', '-')}.json"
    Path(args.out, name).write_text(json.dumps({"gpu": gpu, "args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
