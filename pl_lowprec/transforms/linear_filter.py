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
    """Whether a module name matches one of the glob ``patterns`` (``"lm_head"``, ``"*.head"``), as a whole or
    in its last dotted parts, as peft matches ``target_modules``: ``"lm_head"`` names ``model.lm_head`` too (a
    module holding a Hugging Face model as ``self.model`` has no top-level ``lm_head``)."""
    return any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase(name, f"*.{p}") for p in patterns)


def unmatched_skip_patterns(model: nn.Module, patterns: Sequence[str]) -> list[str]:
    """The patterns of a user's ``skip_modules`` that name no linear layer of ``model``: they leave nothing out,
    so what they were meant to keep in full precision is transformed. The default list names heads any model may
    lack, and is not checked."""
    if tuple(patterns) == DEFAULT_SKIP:
        return []
    matched = matched_patterns(model, patterns)
    return [p for p in patterns if p not in matched]


def matched_patterns(model: nn.Module, patterns: Sequence[str]) -> list[str]:
    """The ``skip_modules`` patterns that name a linear layer of ``model``."""
    names = linear_names(model)
    return [p for p in patterns if any(matches_any(name, [p]) for name in names)]


def check_skip_modules(model: nn.Module, patterns: Sequence[str], owner: str) -> None:
    """Refuse a ``skip_modules`` pattern of ``owner`` (``QuantizationConfig``) that names no linear layer."""
    unmatched = unmatched_skip_patterns(model, patterns)
    if not unmatched:
        return
    names = linear_names(model)
    shown = ", ".join(names[:3] + (["...", names[-1]] if len(names) > 3 else []))
    raise ValueError(
        f"{owner}(skip_modules={list(patterns)}): {', '.join(map(repr, unmatched))} names no linear layer of"
        f" {type(model).__name__}, so it keeps nothing out of the transform. A pattern matches a layer's full name"
        f" or its last dotted parts (as peft's target_modules): 'lm_head' matches 'model.lm_head'. The linear"
        f" layers are {shown or 'none'}. Correct the pattern, or leave skip_modules out to keep the output heads"
        " (the default)."
    )


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
