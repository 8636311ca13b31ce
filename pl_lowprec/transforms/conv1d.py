"""GPT-2's ``Conv1D`` layers as ``nn.Linear``, so that quantization, LoRA's ``all-linear``, the memory estimate and
FSDP2 treat them as the linear layers they are.

transformers' ``Conv1D`` (GPT-2, DistilGPT-2, GPT) is a linear layer whose weight is stored transposed,
``[in, out]``. transformers' own bitsandbytes integration quantizes it as a linear layer, transposing the weight as
it loads; here the layer becomes an ``nn.Linear`` before anything loads, and the checkpoint keeps Conv1D's layout:
the loader transposes each converted weight as it streams in (``stored_transposed``), and the exports write the
weights and the LoRA deltas back in that layout (``conv1d_weights``), so transformers loads them as before.
"""

from __future__ import annotations

import torch
from torch import nn

STORED_TRANSPOSED = "_pl_lowprec_stored_transposed"  # on each converted layer, for the loader
CONVERTED = "_pl_lowprec_conv1d_weights"  # on the root module: the converted weights' keys, for the exports


def is_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (checked by name: transformers is optional)."""
    return type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers.")


def linear_from_conv1d(model: nn.Module) -> list[str]:
    """Replace every ``Conv1D`` in ``model`` by the equivalent ``nn.Linear`` (its weight transposed; a module on
    the meta device stays there, to be filled by the loader); return their names. Idempotent."""
    converted = [(name, m) for name, m in model.named_modules() if name and is_conv1d(m)]
    for name, conv in converted:
        in_features, out_features = conv.weight.shape
        weight = conv.weight
        linear = nn.Linear(in_features, out_features, bias=conv.bias is not None, device="meta", dtype=weight.dtype)
        if weight.device.type != "meta":
            linear.weight = nn.Parameter(weight.detach().T.contiguous(), requires_grad=weight.requires_grad)
        if conv.bias is not None:
            linear.bias = nn.Parameter(conv.bias.detach(), requires_grad=conv.bias.requires_grad)
        setattr(linear, STORED_TRANSPOSED, True)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, linear)
    if converted:
        setattr(model, CONVERTED, conv1d_weights(model) | {f"{name}.weight" for name, _ in converted})
    return [name for name, _ in converted]


def stored_transposed(owner: nn.Module, attr: str) -> bool:
    """Whether the checkpoint holds this tensor of ``owner`` transposed (a converted ``Conv1D``'s weight)."""
    return attr == "weight" and getattr(owner, STORED_TRANSPOSED, False)


def conv1d_weights(model: nn.Module) -> frozenset[str]:
    """Keys (from ``model``, peft's wrappers left out) of the weights a checkpoint holds in Conv1D's layout."""
    return frozenset(getattr(model, CONVERTED, ()))


def to_checkpoint_layout(tensor: torch.Tensor, key: str, converted: frozenset[str]) -> torch.Tensor:
    """``tensor`` (in the module's layout) as the checkpoint holds it under ``key``."""
    return tensor.T.contiguous() if key in converted else tensor
