"""Refuse quantizing a linear layer whose weight is tied to a parameter that trains.

A module of one's own may tie its output layer to its embedding (``self.proj.weight = self.emb.weight``) under a
name the default ``skip_modules`` does not know (``proj``, ``out``, ``decoder``). Quantization replaces the layer
by a 4/8-bit copy of the weight, which unties them: without ``lora=`` the embedding goes on training and the head
stays as it was, without a word. Transformers' quantizers leave tied layers out; here the user says which way.
"""

from __future__ import annotations

from torch import nn

from pl_lowprec.transforms.linear_filter import matched_patterns
from pl_lowprec.transforms.quantization import QuantizationConfig, will_quantize


def tied_holders(model: nn.Module) -> dict[int, list[str]]:
    """``{id(parameter): names of the distinct modules that hold it}``."""
    holders: dict[int, list[str]] = {}
    for name, module in model.named_modules():
        for param in module.parameters(recurse=False):
            holders.setdefault(id(param), []).append(name)
    return holders


def matched_skip_patterns(model: nn.Module, config: QuantizationConfig) -> list[str]:
    """``config.skip_modules`` as a list to extend: the user's as given, of the default only the patterns that name a
    layer of ``model`` (a pattern that names none is refused once the list is the user's)."""
    return matched_patterns(model, config.skip_modules)


def check_tied_layers_stay_tied(model: nn.Module, config: QuantizationConfig) -> None:
    """``ValueError`` naming each layer ``config`` would quantize whose weight another module holds and trains."""
    holders = tied_holders(model)
    tied = {
        name: [other for other in holders[id(module.weight)] if other != name]
        for name, module in model.named_modules()
        if name and will_quantize(module, name, config) and module.weight.requires_grad
    }
    tied = {name: others for name, others in tied.items() if others}
    if not tied:
        return
    name, others = next(iter(tied.items()))
    shown = ", ".join(f"{n} (tied to {', '.join(o)})" for n, o in tied.items())
    skips = ", ".join(repr(s) for s in (*matched_skip_patterns(model, config), *tied))
    raise ValueError(
        f"quantization={config.mode!r} would replace {shown} by a quantized copy of its weight, which the other"
        f" module goes on training: {name} would stop following {others[0]}, untied without a word. Keep it in full"
        f" precision, as transformers does for tied layers: QuantizationConfig(mode={config.mode!r},"
        f" skip_modules=[{skips}]); or set lora= (the tied weight is then frozen), or freeze {others[0]} yourself."
    )
