"""Precision plugins, passed through ``Trainer(plugins=[...])``."""

from pl_lowprec.plugins.amp import AMPPrecision
from pl_lowprec.plugins.loss_scale import LossScaleCollapseError, LossScaleState
from pl_lowprec.plugins.precision_choice import PrecisionChoice, choose_precision
from pl_lowprec.plugins.scheduler_guard import SkipAwareScheduler

__all__ = [
    "AMPPrecision",
    "LossScaleCollapseError",
    "LossScaleState",
    "PrecisionChoice",
    "SkipAwareScheduler",
    "choose_precision",
]
