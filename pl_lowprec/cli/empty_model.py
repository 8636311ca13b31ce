"""A config whose strategy names ``pretrained=`` gets its model built with the parameters on the meta device.

In Python, ``trainer.init_module(empty_init=True)`` does this through the strategy's ``tensor_init_context``.
LightningCLI builds the model before the trainer, outside any such context, so a module that builds its network in
``__init__`` (``self.model = AutoModelForCausalLM.from_config(...)``) held random weights, which the strategy
refuses to overwrite. Here the model's instantiation runs under ``empty_weights()`` (parameters on meta, buffers
real) where the strategy's ``init_args`` name ``pretrained``: the strategy fills it, quantizing as it loads, in
``fit``, ``export``, ``generate`` and ``estimate`` alike.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

from pl_lowprec.loading import empty_weights


def strategy_pretrained(config: dict[str, Any]) -> Any:
    """The ``pretrained`` of a subcommand's ``trainer.strategy`` (its ``init_args``), or ``None``."""
    strategy = (config.get("trainer") or {}).get("strategy")
    if not isinstance(strategy, dict):
        return None
    return (strategy.get("init_args") or {}).get("pretrained")


class EmptyWhenPretrained:
    """A jsonargparse instantiator for the model: ``instantiate`` (Lightning's, which records the hyperparameters)
    under ``empty_weights()`` when ``config()`` names a pretrained checkpoint on the strategy."""

    def __init__(self, instantiate: Callable[..., Any], config: Callable[[], dict[str, Any]]) -> None:
        self.instantiate = instantiate
        self.config = config

    def __call__(self, class_type: type, *args: Any, applied_instantiation_links: dict, **kwargs: Any) -> Any:
        context = empty_weights() if strategy_pretrained(self.config()) is not None else nullcontext()
        with context:
            return self.instantiate(
                class_type, *args, applied_instantiation_links=applied_instantiation_links, **kwargs
            )
