"""Parameter memory after k-bit preparation: pl_lowprec's selective upcast against peft's.

Run: python benchmarks/kbit_prep_memory.py
A TinyLlama (hidden 256, 4 layers) loaded in bf16 as Hugging Face users load it, nf4-dq base weights, LoRA
r=8 on all linear layers (fp32 adapters in both). peft's ``prepare_model_for_kbit_training`` upcasts every
non-quantized parameter (embeddings, head, norms) to fp32; ``pl_lowprec.lora.prepare_for_kbit_training``
upcasts only the adapters and norms. Exact byte counts, no timing.
"""

from __future__ import annotations

import peft
import torch
from common import markdown_table, write_json

from pl_lowprec.demo import TinyLlama
from pl_lowprec.lora import inject_lora, prepare_for_kbit_training
from pl_lowprec.memory.breakdown import parameter_bytes
from pl_lowprec.quantization import QuantizationConfig, quantize_model


def quantized_bf16_llama() -> torch.nn.Module:
    model = TinyLlama(hidden_size=256, intermediate_size=704, num_layers=4, num_heads=8).model.to(torch.bfloat16)
    quantize_model(model, QuantizationConfig.from_mode("nf4-dq"), torch.bfloat16, torch.device("cpu"))
    model.is_loaded_in_4bit = True  # what transformers sets when it loads with bitsandbytes
    return model


def measure() -> dict[str, dict[str, int]]:
    ours = quantized_bf16_llama()
    inject_lora(ours, {"r": 8, "lora_alpha": 16})
    prepare_for_kbit_training(ours, mixed_precision=True)

    theirs = quantized_bf16_llama()
    theirs = peft.prepare_model_for_kbit_training(theirs, use_gradient_checkpointing=False)
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")
    theirs = peft.get_peft_model(theirs, config)  # the documented QLoRA recipe (fp32 adapters)
    return {"pl_lowprec": parameter_bytes(ours), "peft prepare_model_for_kbit_training": parameter_bytes(theirs)}


def main() -> dict:
    result = measure()
    keys = sorted({k for v in result.values() for k in v})
    totals = {name: sum(v.values()) for name, v in result.items()}
    rows = [(name, *(v.get(k, 0) for k in keys), totals[name]) for name, v in result.items()]
    print("Parameter bytes after k-bit preparation (TinyLlama hidden 256, 4 layers, bf16, nf4-dq, LoRA r=8)\n")
    print(markdown_table(["preparation", *keys, "total"], rows))
    ratio = totals["pl_lowprec"] / totals["peft prepare_model_for_kbit_training"]
    print(f"\npl_lowprec / peft total: {ratio:.3f}")
    write_json("kbit_prep_memory", {"bytes": result, "totals": totals, "ratio": ratio})
    return result


if __name__ == "__main__":
    main()
