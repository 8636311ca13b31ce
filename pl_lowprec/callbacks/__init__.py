"""Callbacks that report loss-scale health and where the memory went, through any Lightning logger."""

from pl_lowprec.callbacks.loss_scale_monitor import LossScaleMonitor, PersistentOverflowError
from pl_lowprec.callbacks.memory_tracker import MemoryTracker
from pl_lowprec.callbacks.model_summary import LowPrecisionModelSummary, LowPrecisionRichModelSummary
from pl_lowprec.callbacks.overflow_locator import OverflowLocation
from pl_lowprec.callbacks.progress import StepLimitedRichProgressBar, StepLimitedTQDMProgressBar

__all__ = [
    "LossScaleMonitor",
    "LowPrecisionModelSummary",
    "LowPrecisionRichModelSummary",
    "MemoryTracker",
    "OverflowLocation",
    "PersistentOverflowError",
    "StepLimitedRichProgressBar",
    "StepLimitedTQDMProgressBar",
]
