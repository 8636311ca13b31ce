"""Callbacks that report loss-scale health and where the memory went, through any Lightning logger, and
Lightning's own callbacks (checkpoint, summary, progress bar) made to tell the truth about a low-precision run."""

from pl_lowprec.callbacks.loss_scale_monitor import LossScaleMonitor, PersistentOverflowError
from pl_lowprec.callbacks.memory_tracker import MemoryTracker
from pl_lowprec.callbacks.model_summary import LowPrecisionModelSummary, LowPrecisionRichModelSummary
from pl_lowprec.callbacks.overflow_locator import OverflowLocation
from pl_lowprec.callbacks.progress import StepLimitedRichProgressBar, StepLimitedTQDMProgressBar
from pl_lowprec.callbacks.step_boundary_checkpoint import StepBoundaryCheckpoint

__all__ = [
    "LossScaleMonitor",
    "LowPrecisionModelSummary",
    "LowPrecisionRichModelSummary",
    "MemoryTracker",
    "OverflowLocation",
    "PersistentOverflowError",
    "StepBoundaryCheckpoint",
    "StepLimitedRichProgressBar",
    "StepLimitedTQDMProgressBar",
]
