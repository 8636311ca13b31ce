"""Strategies that transform the model (activation checkpointing, later quantization and LoRA) before training.

Importing this package registers ``"lowprec"``, ``"lowprec_ddp"``, ``"lowprec_ddp_spawn"`` and ``"lowprec_fsdp"``
in Lightning's ``StrategyRegistry``, so ``Trainer(strategy="lowprec_ddp")`` works.
"""

from lightning.pytorch.strategies import StrategyRegistry

from pl_lowprec.strategies.ddp import LowPrecisionDDPStrategy
from pl_lowprec.strategies.fsdp import LowPrecisionFSDPStrategy
from pl_lowprec.strategies.single_device import LowPrecisionStrategy
from pl_lowprec.transforms.pipeline import ModelTransform

LowPrecisionStrategy.register_strategies(StrategyRegistry)
LowPrecisionDDPStrategy.register_strategies(StrategyRegistry)
LowPrecisionFSDPStrategy.register_strategies(StrategyRegistry)

__all__ = ["LowPrecisionDDPStrategy", "LowPrecisionFSDPStrategy", "LowPrecisionStrategy", "ModelTransform"]
