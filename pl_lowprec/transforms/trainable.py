"""What a transformed model trains, said in one line where a config may not mean it.

``quantization=`` without ``lora=`` freezes every quantized linear layer (4- and 8-bit weights take no
gradient), so what is left to train is the rest: embeddings, an unquantized head, norms. That is a legitimate
run, and also the usual result of a config that lost its ``lora:`` section; one line names what trains.
"""

from __future__ import annotations

import torch
from torch import nn

from pl_lowprec.transforms.nf4 import is_nf4
from pl_lowprec.transforms.quantization import is_quantized


def trainable_parts(model: nn.Module) -> dict[str, int]:
    """Trainable parameters by what holds them: ``embeddings``, ``norms``, a linear layer by its name
    (``lm_head``), else the module's class; a tied weight counts once."""
    parts: dict[str, int] = {}
    seen: set[int] = set()
    for name, module in model.named_modules():
        for param in module.parameters(recurse=False):
            if not param.requires_grad or id(param) in seen:
                continue
            seen.add(id(param))
            parts[_part(name, module)] = parts.get(_part(name, module), 0) + param.numel()
    return parts


def _part(name: str, module: nn.Module) -> str:
    if isinstance(module, nn.Embedding):
        return "embeddings"
    if "norm" in type(module).__name__.lower():
        return "norms"
    if isinstance(module, nn.Linear):
        return name.rpartition(".")[2] or "linear"
    return type(module).__name__


def parameter_count(model: nn.Module) -> int:
    """Every parameter, a quantized layer's weight at its unquantized size (its storage packs several in a byte)."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        if is_quantized(module):
            seen.add(id(module.weight))
            total += module.in_features * module.out_features
        for param in module.parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                total += param.numel()
    return total


def quantized_layers(model: nn.Module) -> int:
    """Linear layers with quantized weights: bitsandbytes' layers, or torchao NF4 weights (under FSDP2)."""
    return sum(is_quantized(m) or is_nf4_weight(getattr(m, "weight", None)) for m in model.modules())


def is_nf4_weight(weight: object) -> bool:
    return isinstance(weight, torch.Tensor) and is_nf4(weight)


def without_lora_line(model: nn.Module, mode: str) -> str:
    """The line for ``quantization=mode`` without ``lora=``: what trains, of how many parameters."""
    parts = trainable_parts(model)
    listed = ", ".join(f"{part} ({count:,})" for part, count in sorted(parts.items(), key=lambda kv: -kv[1]))
    total = parameter_count(model)
    what = f"only {sum(parts.values()):,} of {total:,} parameters train: {listed}" if parts else "nothing trains"
    return (
        f"lora is null: with quantization={mode!r} the {quantized_layers(model)} quantized linear layers are frozen,"
        f" and {what}. Set lora= to train adapters on them (QLoRA)."
    )
