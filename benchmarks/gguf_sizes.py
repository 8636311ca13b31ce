"""What each ``--gguf_type`` makes of real models: the bytes of their tensors, from the config alone.

The export's own plan (``gguf_convert.plan_tensors``: llama.cpp's tensor names and each tensor's type, as the
export chooses it) over a model built on the meta device, each tensor's bytes as the file stores them
(``gguf_types.stored_as``). The file adds its metadata, mostly the tokenizer (a few MB for a 128k vocabulary).

    python benchmarks/gguf_sizes.py [--shapes DIR]

DIR holds real models' ``config.json`` files (default: ``../shared/model-shapes``, else the configs the tests
embed).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

MODELS = {  # file in --shapes -> column name
    "smollm2-135m.json": "SmolLM2-135M",
    "qwen2.5-0.5b.json": "Qwen2.5-0.5B",
    "llama-3.2-1b.json": "Llama-3.2-1B",
    "mistral-7b-v0.3.json": "Mistral-7B-v0.3",
    "llama-3.1-8b.json": "Llama-3.1-8B",
    "llama-3.1-70b.json": "Llama-3.1-70B",
}


def configs(shapes: Path) -> dict[str, dict]:
    if shapes.is_dir():
        return {name: json.loads((shapes / f).read_text()) for f, name in MODELS.items() if (shapes / f).is_file()}
    from model_shapes import LLAMA31_8B, QWEN25_05B, SMOLLM2_135M

    return {"SmolLM2-135M": SMOLLM2_135M, "Qwen2.5-0.5B": QWEN25_05B, "Llama-3.1-8B": LLAMA31_8B}


def tensor_bytes(fields: dict, gguf_type: str) -> tuple[int, int]:
    """(bytes of every tensor, parameters) of the model ``fields`` describe, written as ``gguf_type``."""
    import gguf
    from transformers import AutoConfig, AutoModelForCausalLM

    from pl_lowprec.export.gguf_arch import architecture
    from pl_lowprec.export.gguf_convert import plan_tensors
    from pl_lowprec.export.gguf_types import stored_as

    fields = {k: v for k, v in fields.items() if k not in ("architectures", "torch_dtype")}
    config = AutoConfig.for_model(**fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    sources = ((None, key, tuple(tensor.shape)) for key, tensor in model.state_dict().items())
    planned = plan_tensors(gguf, sources, config, architecture(config), gguf_type)
    parameters = sum(int(torch.Size(item.shape).numel()) for item in planned if item.key is not None)
    return sum(stored_as(gguf, item.shape, item.qtype)[2] for item in planned), parameters


def main() -> None:
    from pl_lowprec.export.gguf_types import GGUF_TYPES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", type=Path, default=ROOT.parent / "shared" / "model-shapes")
    args = parser.parse_args()
    models = configs(args.shapes)
    print("| `--gguf_type` | " + " | ".join(models) + " |")
    print("|---|" + "---|" * len(models))
    for gguf_type in GGUF_TYPES:
        cells = []
        for fields in models.values():
            size, parameters = tensor_bytes(fields, gguf_type)
            cells.append(f"{size / 1e9:,.2f} GB ({size * 8 / parameters:.2f} bits)")
        print(f"| {gguf_type} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
