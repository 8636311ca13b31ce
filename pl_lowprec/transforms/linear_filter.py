"""Which ``nn.Linear`` layers a transform touches: the one filter behind every ``skip_modules``, and the one
function that swaps layers.

Quantization, QAT and float8 replace exact ``nn.Linear`` instances only: subclasses such as
``MultiheadAttention.out_proj`` are read as raw weights by their parent and must stay as they are. LoRA adapts
any linear layer, bitsandbytes' ones included (they subclass ``nn.Linear``). All of them leave the output heads
alone by default.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Sequence

from torch import nn

# Output heads stay in full precision: quantizing the logits layer hurts quality most and saves little.
DEFAULT_SKIP = ("lm_head", "*.lm_head", "head", "*.head", "score", "*.score", "classifier", "*.classifier")


def matches_any(name: str, patterns: Sequence[str]) -> bool:
    """Whether a module name matches one of the glob ``patterns`` (``"lm_head"``, ``"*.head"``)."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in patterns)


def is_target_linear(module: nn.Module, name: str, skip_modules: Sequence[str], exact: bool = True) -> bool:
    """Whether a transform with these ``skip_modules`` touches this module: an ``nn.Linear`` (exactly, unless
    ``exact=False`` also takes its subclasses) whose name matches none of the patterns."""
    linear = type(module) is nn.Linear if exact else isinstance(module, nn.Linear)
    return linear and not matches_any(name, skip_modules)


def linear_names(model: nn.Module) -> list[str]:
    """Names of all linear layers, plain or bitsandbytes (which subclass ``nn.Linear``)."""
    return [name for name, m in model.named_modules() if name and isinstance(m, nn.Linear)]


def swap_linear_layers(
    model: nn.Module,
    make_layer: Callable[[nn.Linear, str], nn.Module],
    module_filter: Callable[[nn.Module, str], bool],
) -> list[str]:
    """Replace every module for which ``module_filter(module, name)`` holds by ``make_layer(module, name)``."""
    chosen = [(name, m) for name, m in model.named_modules() if name and module_filter(m, name)]
    for name, module in chosen:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, make_layer(module, name))
    return [name for name, _ in chosen]
