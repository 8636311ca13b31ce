"""Bytes per quantized base weight, every constant included (absmax, nested constants, shared code books).

Run: python benchmarks/run_all.py --only quantized_bytes   (or python benchmarks/quantized_bytes.py)
Exact byte counts of TinyLlama's linear layers (the output head stays unquantized and is left out), after
``pl_lowprec.transforms.quantization.quantize_model``, counted by ``pl_lowprec.memory.breakdown.parameter_bytes``.
"""

from __future__ import annotations

from typing import Any

import torch
from common import device, markdown_table, section, write_json

from pl_lowprec.demo import TinyLlama
from pl_lowprec.memory.breakdown import parameter_bytes
from pl_lowprec.transforms.quantization import QUANT_MODES, QuantizationConfig, quantize_model

HIDDEN_SIZES = (128, 512)


def bytes_per_parameter(mode: str, hidden: int) -> float:
    model = TinyLlama(hidden_size=hidden, intermediate_size=hidden * 11 // 4, num_layers=2, num_heads=8).model
    quantized = sum(
        m.weight.numel() for name, m in model.named_modules() if type(m) is torch.nn.Linear and "lm_head" not in name
    )
    quantize_model(model, QuantizationConfig.from_mode(mode), torch.float32, device())
    if mode == "int8":
        model(input_ids=torch.zeros(1, 4, dtype=torch.long, device=device()))  # bitsandbytes moves scales on first use
    return sum(v for k, v in parameter_bytes(model).items() if k.startswith("quantized")) / quantized


def main(argv: list[str] | None = None) -> dict[str, Any]:
    result = {mode: {h: bytes_per_parameter(mode, h) for h in HIDDEN_SIZES} for mode in QUANT_MODES}
    section("Quantized weights: bytes per parameter, constants included (TinyLlama, 2 layers)")
    headers = ["mode", *(f"hidden {h}" for h in HIDDEN_SIZES)]
    print(markdown_table(headers, [(mode, *(f"{v[h]:.4f}" for h in HIDDEN_SIZES)) for mode, v in result.items()]))
    write_json("quantized_bytes", {"bytes_per_parameter": result})
    return result


if __name__ == "__main__":
    main()
