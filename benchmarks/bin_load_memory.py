"""Peak resident memory of loading pytorch_model.bin files, streamed (pretrained=) against from_pretrained.

Run: python benchmarks/bin_load_memory.py   (about a minute on 2 CPU cores; nothing asserted)

A Llama of 57M parameters (hidden 768, 8 layers, MLP 2048, vocab 256, untied), random weights, saved once as
safetensors (``save_pretrained``) and as ``pytorch_model.bin`` in 2 shards with ``pytorch_model.bin.index.json``
(``tests/loading_helpers.bin_copy``), in fp32 and in bf16. Each case is a fresh process, timed from after the
imports and the meta build (peak reset then, as ``tests/_scripts/load_memory.py`` does), and touches every weight
after loading (one forward pass), so a mapping left untouched by one loader cannot look cheaper. Cases:
- ``from_pretrained``: ``AutoModelForCausalLM.from_pretrained(dir, dtype=fp32)``.
- ``streamed``: the model built under ``empty_weights()`` in fp32, then ``load_pretrained(model, dir)``.
- ``... nf4-dq``: ``from_pretrained`` then ``quantize_model``, against ``load_pretrained(quantization=nf4-dq)``.
Run with MALLOC_MMAP_THRESHOLD_=1048576 (set here for the children), as the load-memory test does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

MiB = 2**20
CPU = torch.device("cpu")
TESTS = Path(__file__).resolve().parents[1] / "tests"


def config():
    """The Llama of tests/_scripts/load_memory.py (its plain values, without that script's imports)."""
    sys.path.insert(0, str(TESTS / "_scripts"))
    from load_memory_llama import LOAD_MEMORY_LLAMA
    from transformers import LlamaConfig

    return LlamaConfig(**LOAD_MEMORY_LLAMA)


def write(root: Path) -> None:
    sys.path.insert(0, str(TESTS))
    from loading_helpers import bin_copy
    from transformers import LlamaForCausalLM

    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        name = str(dtype).removeprefix("torch.")
        LlamaForCausalLM(config()).to(dtype).save_pretrained(root / f"{name}-safetensors")
        bin_copy(root / f"{name}-safetensors", root / f"{name}-bin", shards=2)


def case(loader: str, directory: str, quantize: bool) -> dict:
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from pl_lowprec.loading import empty_weights, load_pretrained
    from pl_lowprec.memory.process import memory_stats, reset_peak
    from pl_lowprec.transforms.quantization import QuantizationConfig, quantize_linear, quantize_model

    torch.set_num_threads(1)
    quantization = QuantizationConfig.from_mode("nf4-dq") if quantize else None
    with empty_weights():
        model = LlamaForCausalLM(config())
    fp32_bytes = sum(p.numel() * 4 for p in model.parameters())
    if quantization is not None:
        quantize_linear(torch.nn.Linear(64, 64), quantization, torch.float32, CPU)  # bitsandbytes' library, once
    reset_peak(CPU)
    before = memory_stats(CPU)["rss_current"]
    if loader == "streamed":
        load_pretrained(model, directory, quantization=quantization)
    else:
        del model
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
        if quantization is not None:
            quantize_model(model, quantization, torch.float32, CPU)
    after_load = memory_stats(CPU)["rss_peak"] - before
    with torch.no_grad():
        model(input_ids=torch.zeros(1, 8, dtype=torch.long))
    stats = memory_stats(CPU)
    return {
        "fp32_model_bytes": fp32_bytes,
        "load_peak_bytes": after_load,
        "peak_with_forward_bytes": stats["rss_peak"] - before,
        "held_bytes": stats["rss_current"] - before,
    }


def run(*args: str) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "1048576"}
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, env=env, check=False)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1]) if args[0] == "case" else {}


def main() -> None:
    from common import describe_machine, machine_info

    print(describe_machine(machine_info()))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        run("write", tmp)
        for stored in ("float32", "bfloat16"):
            for fmt in ("bin", "safetensors"):
                for quantize in (False, True):
                    for loader in ("from_pretrained", "streamed"):
                        got = run("case", loader, str(root / f"{stored}-{fmt}"), "1" if quantize else "0")
                        what = f"{loader}{' + nf4-dq' if quantize else ''}"
                        rows.append((stored, fmt, what, got))
    size = rows[0][3]["fp32_model_bytes"] / MiB
    print(f"57M-parameter Llama, {size:.0f} MiB in fp32; RSS added above the baseline, MiB")
    print("| stored | files | load | load peak | peak with a forward | held after |")
    print("|---|---|---|---|---|---|")
    for stored, fmt, what, got in rows:
        figures = [got[k] / MiB for k in ("load_peak_bytes", "peak_with_forward_bytes", "held_bytes")]
        print(f"| {stored} | {fmt} | {what} | " + " | ".join(f"{f:.0f}" for f in figures) + " |")


if __name__ == "__main__":
    if sys.argv[1:2] == ["write"]:
        write(Path(sys.argv[2]))
    elif sys.argv[1:2] == ["case"]:
        print(json.dumps(case(sys.argv[2], sys.argv[3], sys.argv[4] == "1")))
    else:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        main()
