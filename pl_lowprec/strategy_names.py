"""The strategy names (``Trainer(strategy="lowprec_ddp")``), registered with Lightning on ``import pl_lowprec``.

Each name first maps to a small factory, so ``import pl_lowprec`` does not import the strategies (and the
libraries behind them). Building one imports ``pl_lowprec.strategies``, whose classes register themselves under
the same names with their own descriptions and arguments (``register_strategies``), and returns that entry.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib import import_module
from typing import Any

from lightning.pytorch.strategies import Strategy, StrategyRegistry

STRATEGY_NAMES = ("lowprec", "lowprec_ddp", "lowprec_ddp_spawn", "lowprec_fsdp")


def _factory(name: str) -> Callable[[], Strategy]:
    def build() -> Strategy:
        import_module("pl_lowprec.strategies")  # replaces this entry by the class's own
        return StrategyRegistry.get(name)

    return build


def register_strategy_names() -> None:
    """Register every name that is not registered yet (a class registered first keeps its entry)."""
    for name in STRATEGY_NAMES:
        if name not in StrategyRegistry:
            StrategyRegistry.register(name, _factory(name), description="pl_lowprec (imported when built)")


def registered_strategy(name: str) -> tuple[type, dict[str, Any]] | None:
    """The class and arguments a registered strategy name builds, without building it (this package's names as
    their classes, not the factories above); ``None`` for a name nobody registered."""
    if name in STRATEGY_NAMES:
        import_module("pl_lowprec.strategies")
    entry = dict.get(StrategyRegistry, name)  # the registry's own ``get`` builds the strategy
    return (entry["strategy"], dict(entry["init_params"])) if entry is not None else None
