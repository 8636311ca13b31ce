"""Refuse optimizers that would train nothing of the transformed model.

The transform replaces layers (quantization, float8, QAT) and adds parameters (LoRA) before
``configure_optimizers`` runs. A module that collected its parameters earlier (a list made in ``__init__``, as a
plain Lightning run allows) hands the optimizer the old tensors: the adapters get gradients that no optimizer
steps, the run trains nothing and says nothing. Caught once, when the optimizers are set up.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.optim import Optimizer


def check_optimizers_train_the_model(module: nn.Module, optimizers: Sequence[Optimizer]) -> None:
    """``ValueError`` where ``optimizers`` hold none of ``module``'s trainable parameters, or leave out some of its
    LoRA adapters; nothing to check where ``configure_optimizers`` returned no optimizer."""
    if not optimizers:
        return
    optimized = {id(p) for optimizer in optimizers for group in optimizer.param_groups for p in group["params"]}
    trainable = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
    left_out = [name for name, p in trainable if id(p) not in optimized]
    adapters_left_out = [name for name in left_out if ".lora_" in name]
    if not trainable or not (adapters_left_out or len(left_out) == len(trainable)):
        return
    foreign = len(optimized - {id(p) for p in module.parameters()})
    held = f", {foreign} of them no longer the model's" if foreign else ""
    raise ValueError(
        f"configure_optimizers returned optimizers over {len(optimized):,} parameters{held}, and"
        f" {len(adapters_left_out or left_out)} of the model's {len(trainable)} trainable parameters are in none"
        f" of them (e.g. {(adapters_left_out or left_out)[0]}): they would get gradients that nothing steps. The"
        " strategy transforms the model (LoRA adapters added, layers quantized or replaced) before"
        " configure_optimizers runs, so the parameters must be read there, after it: build the optimizer from"
        " self.parameters() or self.named_parameters() inside configure_optimizers, not from a list made in"
        " __init__."
    )
