"""``LowPrecisionDDPStrategy``: Lightning's DDP plus the model transform (``"lowprec_ddp"``, ``"lowprec_ddp_spawn"``).

The transform runs on every rank before the DDP wrapper, so DDP sees the final parameters (only trainable ones
are reduced) and every rank holds the same transformed model.
"""

from __future__ import annotations

from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.strategy import _StrategyRegistry

from pl_lowprec.distributed.process_group_exit import destroy_process_group_at_exit
from pl_lowprec.distributed.spawn_results import TransformingSpawnLauncher
from pl_lowprec.strategies.transform_hooks import TransformHooks


class LowPrecisionDDPStrategy(TransformHooks, DDPStrategy):
    """DDP that transforms the model once per fit (see ``pl_lowprec.transforms.pipeline``).

    Takes the model arguments below and every argument of ``DDPStrategy`` (``process_group_backend``,
    ``find_unused_parameters``, ...).
    """

    strategy_name = "lowprec_ddp"

    def _configure_launcher(self) -> None:
        """``popen`` as Lightning's; ``spawn`` with the main process's module transformed before rank 0's weights
        load into it (``distributed/spawn_results.py``)."""
        super()._configure_launcher()
        if self._start_method != "popen":
            self._launcher = TransformingSpawnLauncher(self, start_method=self._start_method)

    def setup_environment(self) -> None:
        super().setup_environment()
        destroy_process_group_at_exit(self)

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        for name, start_method in ((cls.strategy_name, "popen"), (f"{cls.strategy_name}_spawn", "spawn")):
            strategy_registry.register(
                name,
                cls,
                description=f"DDP ({start_method}) with activation checkpointing and QLoRA",
                override=True,
                start_method=start_method,
            )
