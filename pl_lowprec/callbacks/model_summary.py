"""Lightning's model summary with a quantized model's true parameter count and size.

Lightning counts a bitsandbytes 4-bit weight by its packed storage (two weights a byte: half its parameters),
and sizes the model at 4 bytes a parameter under mixed precision, with a warning that the size is not accurate.
A 2-layer SmolLM2-135M in nf4 with LoRA read "32.0 M params, 128 MB" where it holds 35.6 M parameters in 61 MB.
This summary counts each quantized weight at its logical shape (``quant_state.shape``; peft's
``get_nb_trainable_parameters`` doubles the packed count to the same figure) and gives the size as the bytes the
parameters hold, quantization constants included: the ``params_*`` figures of ``MemoryTracker``, summed over the
ranks' shards under FSDP2. ``pl-lowprec`` and the strategies use it in place of Lightning's default summary;
pass ``LowPrecisionModelSummary`` (or ``LowPrecisionRichModelSummary``) in ``callbacks`` to use it elsewhere.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelSummary as ModelSummaryCallback
from lightning.pytorch.callbacks import RichModelSummary
from lightning.pytorch.utilities.model_summary import ModelSummary
from torch import nn
from torch.distributed.tensor import DTensor

from pl_lowprec.callbacks.swap import swap_default_callbacks
from pl_lowprec.memory.breakdown import parameter_bytes


def logical_numel(param: torch.Tensor) -> int:
    """Parameters a weight stands for: a 4-bit weight's unpacked shape, else its own element count."""
    state = getattr(param, "quant_state", None)
    shape = getattr(state, "shape", None)
    return math.prod(shape) if shape is not None else param.numel()


def _parameters(module: nn.Module, trainable_only: bool = False) -> int:
    return sum(logical_numel(p) for p in module.parameters() if p.requires_grad or not trainable_only)


def held_parameter_bytes(trainer: pl.Trainer, model: nn.Module) -> int:
    """Bytes the model's parameters hold, each storage once; under FSDP2 (every parameter a DTensor shard of the
    one data-parallel mesh) summed over the ranks. Every rank calls it."""
    held = sum(parameter_bytes(model).values())
    if trainer.world_size > 1 and any(isinstance(p, DTensor) for p in model.parameters()):
        total = trainer.strategy.reduce(torch.tensor(held, device=trainer.strategy.root_device), reduce_op="sum")
        held = int(total.item())
    return held


class TrueSizeSummary(ModelSummary):
    """Lightning's ``ModelSummary`` with logical parameter counts and the parameters' stored bytes as the size."""

    def __init__(self, model: pl.LightningModule, max_depth: int, held_bytes: int) -> None:
        with warnings.catch_warnings():  # the size below does not depend on the precision's name
            warnings.filterwarnings("ignore", message=r"Precision .* is not supported by the model summary")
            super().__init__(model, max_depth=max_depth)
        self._held_bytes = held_bytes

    @property
    def param_nums(self) -> list[int]:
        return [_parameters(layer._module) for layer in self._layer_summary.values()]

    @property
    def total_parameters(self) -> int:
        return _parameters(self._model)

    @property
    def trainable_parameters(self) -> int:
        return _parameters(self._model, trainable_only=True)

    @property
    def model_size(self) -> float:
        """Megabytes (10^6 bytes, as Lightning's label) the parameters hold."""
        return self._held_bytes * 1e-6


class _TrueSize(ModelSummaryCallback):
    """Builds ``TrueSizeSummary`` where Lightning's summary callbacks build theirs; placed before them."""

    def _summary(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> ModelSummary:
        return TrueSizeSummary(pl_module, self._max_depth, held_parameter_bytes(trainer, pl_module))


class LowPrecisionModelSummary(_TrueSize):
    """Lightning's ``ModelSummary`` callback with ``TrueSizeSummary``'s counts and size."""


class LowPrecisionRichModelSummary(_TrueSize, RichModelSummary):
    """Lightning's ``RichModelSummary`` callback (needs ``rich``) with ``TrueSizeSummary``'s counts and size."""


def use_true_size_model_summary(trainer: pl.Trainer) -> None:
    """Swap Lightning's default model summary (its exact classes, not a user's subclass) for the one that counts
    quantized weights. ``pl-lowprec`` calls it on its Trainer and the strategies in ``setup``, before the summary
    prints in ``on_fit_start``."""

    def keeping_its_settings(summary_class: type) -> Callable[[Any], ModelSummaryCallback]:
        return lambda default: summary_class(default._max_depth, **default._summarize_kwargs)

    swap_default_callbacks(
        trainer,
        {
            RichModelSummary: keeping_its_settings(LowPrecisionRichModelSummary),
            ModelSummaryCallback: keeping_its_settings(LowPrecisionModelSummary),
        },
    )
