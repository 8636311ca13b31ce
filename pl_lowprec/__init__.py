"""pl_lowprec: mixed precision with honest loss scaling, QLoRA, activation checkpointing and accumulation
for any LightningModule, by configuration.

``import pl_lowprec`` registers the strategy names with Lightning (``Trainer(strategy="lowprec_ddp")``,
``"lowprec"``, ``"lowprec_ddp_spawn"``, ``"lowprec_fsdp"``); the strategy classes themselves are imported when
first asked for (``from pl_lowprec import LowPrecisionStrategy``) or built by name.
"""

from importlib import import_module
from typing import Any

from pl_lowprec._imports import filter_import_noise
from pl_lowprec.callbacks import LossScaleMonitor, MemoryTracker, PersistentOverflowError
from pl_lowprec.memory.estimate import MemoryEstimate, estimate_memory
from pl_lowprec.plugins import (
    AMPPrecision,
    LossScaleCollapseError,
    LossScaleState,
    PrecisionChoice,
    SkipAwareScheduler,
    choose_precision,
)
from pl_lowprec.strategy_names import register_strategy_names
from pl_lowprec.transforms.checkpointing import remove_activation_checkpointing, set_activation_checkpointing
from pl_lowprec.transforms.fp8 import FP8Config
from pl_lowprec.transforms.qat import QATConfig
from pl_lowprec.transforms.quantization import QuantizationConfig

filter_import_noise()  # before anything (transformers, peft) imports torchao or bitsandbytes; see pl_lowprec._imports
register_strategy_names()

__all__ = [
    "AMPPrecision",
    "FP8Config",
    "LossScaleCollapseError",
    "LossScaleMonitor",
    "LossScaleState",
    "LowPrecisionDDPStrategy",
    "LowPrecisionFSDPStrategy",
    "LowPrecisionStrategy",
    "MemoryEstimate",
    "MemoryTracker",
    "PersistentOverflowError",
    "PrecisionChoice",
    "QATConfig",
    "QuantizationConfig",
    "SkipAwareScheduler",
    "choose_precision",
    "estimate_memory",
    "remove_activation_checkpointing",
    "set_activation_checkpointing",
]
__version__ = "0.1.0"

_LAZY = {
    "LowPrecisionStrategy": "pl_lowprec.strategies",
    "LowPrecisionDDPStrategy": "pl_lowprec.strategies",
    "LowPrecisionFSDPStrategy": "pl_lowprec.strategies",
}


def __getattr__(name: str) -> Any:
    """The strategy classes, imported when first asked for."""
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
