"""pl_lowprec: mixed precision with honest loss scaling, QLoRA, activation checkpointing and accumulation
for any LightningModule, by configuration."""

from pl_lowprec.callbacks import LossScaleMonitor, MemoryTracker, PersistentOverflowError
from pl_lowprec.checkpointing import remove_activation_checkpointing, set_activation_checkpointing
from pl_lowprec.memory.estimate import MemoryEstimate, estimate_memory
from pl_lowprec.plugins import (
    AMPPrecision,
    LossScaleCollapseError,
    LossScaleState,
    PrecisionChoice,
    SkipAwareScheduler,
    choose_precision,
)
from pl_lowprec.quantization import QuantizationConfig
from pl_lowprec.strategies import LowPrecisionDDPStrategy, LowPrecisionFSDPStrategy, LowPrecisionStrategy

__all__ = [
    "AMPPrecision",
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
    "QuantizationConfig",
    "SkipAwareScheduler",
    "choose_precision",
    "estimate_memory",
    "remove_activation_checkpointing",
    "set_activation_checkpointing",
]
__version__ = "0.1.0"
