"""``--optimizer``/``--lr_scheduler`` built when Lightning asks ``configure_optimizers``, not when the CLI starts.

LightningCLI builds the optimizer of ``--optimizer AdamW`` when it instantiates the classes, from the module's
parameters at that moment. Under this package's strategies those are not the parameters that train: the strategy
quantizes the base and adds the LoRA adapters later, in ``setup``, so the optimizer held the replaced weights and
none of the adapters (the quick-start with ``--optimizer AdamW`` held 21 tensors, none of its 28 trainable ones:
nothing trained, and nothing said so); and a module that builds its model in ``configure_model``
(``CausalLM``) had no parameter yet ("optimizer got an empty parameter list"). Here the same classes and
arguments are built when Lightning calls ``configure_optimizers`` (after ``configure_model`` and the strategy's
transform), from the parameters that train then.
"""

from __future__ import annotations

from functools import update_wrapper
from types import MethodType
from typing import Any

from lightning.pytorch.cli import LightningCLI, LRSchedulerTypeTuple, _global_add_class_path, instantiate_class
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.optim import Optimizer


def _automatic(register: dict[str, tuple[Any, str]], kind: type | tuple[type, ...]) -> list[str]:
    """The argument groups LightningCLI links to ``configure_optimizers`` (``"AUTOMATIC"``) of ``kind``."""
    found = []
    for key, (base, link_to) in register.items():
        bases = base if isinstance(base, tuple) else (base,)
        if link_to == "AUTOMATIC" and any(issubclass(b, kind) for b in bases):
            found.append(key)
    return found


def defer_configure_optimizers(cli: Any, subcommand: str | None) -> None:
    """``LightningCLI._add_configure_optimizers_method_to_model``, with the optimizer and scheduler built at
    ``configure_optimizers`` time from the parameters that require gradients then."""
    if not cli.auto_configure_optimizers:
        return
    parser = cli._parser(subcommand)
    optimizers = _automatic(parser._optimizers, Optimizer)
    schedulers = _automatic(parser._lr_schedulers, LRSchedulerTypeTuple)
    if not optimizers:
        return
    if len(optimizers) > 1 or len(schedulers) > 1:  # LightningCLI's own refusal, with its message
        LightningCLI._add_configure_optimizers_method_to_model(cli, subcommand)
        return
    optimizer_class = parser._optimizers[optimizers[0]][0]
    optimizer_init = cli._get(cli.config_init, optimizers[0])
    if not isinstance(optimizer_class, tuple):
        optimizer_init = _global_add_class_path(optimizer_class, optimizer_init)
    if not optimizer_init:
        return  # registered, not given: the module's own configure_optimizers stays
    scheduler_init = None
    if schedulers:
        scheduler_class = parser._lr_schedulers[schedulers[0]][0]
        scheduler_init = cli._get(cli.config_init, schedulers[0])
        if not isinstance(scheduler_class, tuple):
            scheduler_init = _global_add_class_path(scheduler_class, scheduler_init)
    model = cli.model
    if is_overridden("configure_optimizers", model):
        rank_zero_warn(
            f"--optimizer replaces {type(model).__name__}.configure_optimizers (its learning rate and schedule"
            f" included); leave --optimizer out to keep them."
        )

    def configure_optimizers(module: Any) -> Any:
        trainable = [p for p in module.parameters() if p.requires_grad]
        optimizer = instantiate_class(trainable, optimizer_init)
        scheduler = instantiate_class(optimizer, scheduler_init) if scheduler_init else None
        return cli.configure_optimizers(module, optimizer, scheduler)

    update_wrapper(configure_optimizers, cli.configure_optimizers)  # as LightningCLI's replacement reads
    model.configure_optimizers = MethodType(configure_optimizers, model)
