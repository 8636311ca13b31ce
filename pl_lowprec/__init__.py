"""pl_lowprec: mixed precision with honest loss scaling, QLoRA, activation checkpointing and accumulation
for any LightningModule, by configuration."""

from pl_lowprec.plugins import AMPPrecision, LossScaleCollapseError, LossScaleState, SkipAwareScheduler

__all__ = ["AMPPrecision", "LossScaleCollapseError", "LossScaleState", "SkipAwareScheduler"]
__version__ = "0.1.0"
