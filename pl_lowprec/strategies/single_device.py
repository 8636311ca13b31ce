"""``LowPrecisionStrategy``: Lightning's single-device strategy plus the model transform (``"lowprec"``)."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning.pytorch.strategies.strategy import _StrategyRegistry

from pl_lowprec.strategies.transform_hooks import TransformHooks


class LowPrecisionStrategy(TransformHooks, SingleDeviceStrategy):
    """One device; transforms the model once per fit (see ``pl_lowprec.transforms.pipeline``).

    Args:
        device: The device; ``None`` takes the Trainer's (``accelerator``/``devices``).
        **kwargs: ``SingleDeviceStrategy``'s arguments (``accelerator``, ``checkpoint_io``, ``precision_plugin``).
    """

    strategy_name = "lowprec"

    def __init__(self, device: str | torch.device | None = None, **kwargs: Any) -> None:
        super().__init__(device=device or "cpu", **kwargs)
        self._device_from_trainer = device is None

    @property
    def parallel_devices(self) -> list[torch.device] | None:
        """Lets the Trainer's accelerator connector hand over its device when none was given."""
        return None if self._device_from_trainer else [self.root_device]

    @parallel_devices.setter
    def parallel_devices(self, devices: list[torch.device] | None) -> None:
        if self._device_from_trainer and devices:
            self._root_device = devices[0]
            self._device_from_trainer = False

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name, cls, description="Single device with activation checkpointing and QLoRA", override=True
        )
