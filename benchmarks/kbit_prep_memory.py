"""Parameter memory after k-bit preparation: pl_lowprec's selective upcast against peft's.

Run: python benchmarks/run_all.py --only kbit_prep   (or python benchmarks/kbit_prep_memory.py)
A TinyLlama (hidden 256, 4 layers) saved in bf16 with ``save_pretrained`` and loaded in bf16 as Hugging Face
users load it. peft side: ``from_pretrained(dir, quantization_config=BitsAndBytesConfig(nf4, double
quantization, bf16 compute))``, ``prepare_model_for_kbit_training`` (which upcasts every non-quantized
parameter, embeddings and head included, to fp32) and ``get_peft_model`` (fp32 adapters). pl_lowprec side:
the same bf16 checkpoint, ``quantize_model`` (nf4-dq), ``inject_lora`` and ``prepare_for_kbit_training``
(which upcasts only adapters and norms). LoRA r=8 on all linear layers in both. Exact byte counts, no timing.
"""

from __future__ import annotations

import tempfile
from typing import Any

import peft
import torch
from common import markdown_table, section, write_json
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from pl_lowprec.demo import TinyLlama
from pl_lowprec.memory.breakdown import parameter_bytes
from pl_lowprec.transforms.lora import inject_lora, prepare_for_kbit_training
from pl_lowprec.transforms.quantization import QuantizationConfig, quantize_model

LORA = {"r": 8, "lora_alpha": 16}
PEFT = "peft prepare_model_for_kbit_training"


def measure(folder: str) -> dict[str, dict[str, int]]:
    base = TinyLlama(hidden_size=256, intermediate_size=704, num_layers=4, num_heads=8).model.to(torch.bfloat16)
    base.save_pretrained(folder)

    ours = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    quantize_model(ours, QuantizationConfig.from_mode("nf4-dq"), torch.bfloat16, torch.device("cpu"))
    inject_lora(ours, LORA)
    prepare_for_kbit_training(ours, mixed_precision=True)

    nf4 = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    theirs = AutoModelForCausalLM.from_pretrained(folder, quantization_config=nf4, dtype=torch.bfloat16)
    theirs = peft.prepare_model_for_kbit_training(theirs, use_gradient_checkpointing=False)
    theirs = peft.get_peft_model(theirs, peft.LoraConfig(**LORA, target_modules="all-linear"))
    return {"pl_lowprec": parameter_bytes(ours), PEFT: parameter_bytes(theirs)}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        result = measure(folder)
    keys = sorted({k for v in result.values() for k in v})
    totals = {name: sum(v.values()) for name, v in result.items()}
    rows = [(name, *(v.get(k, 0) for k in keys), totals[name]) for name, v in result.items()]
    section("Parameter bytes after k-bit preparation (TinyLlama hidden 256, 4 layers, bf16, nf4-dq, LoRA r=8)")
    print(markdown_table(["preparation", *keys, "total"], rows))
    ratio = totals["pl_lowprec"] / totals[PEFT]
    print(f"\npl_lowprec / peft total: {ratio:.3f}")
    write_json("kbit_prep_memory", {"bytes": result, "totals": totals, "ratio": ratio})
    return {"bytes": result, "totals": totals, "ratio": ratio}


if __name__ == "__main__":
    main()
