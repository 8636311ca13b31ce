"""``--trainer.strategy=lowprec_ddp`` over a config whose strategy has arguments keeps them.

Lightning types ``Trainer(strategy=...)`` as ``str | Strategy``, so jsonargparse reads a strategy name as a plain
string that replaces the config's ``class_path`` and ``init_args`` whole: ``pl-lowprec fit --config qlora.yaml
--trainer.strategy=lowprec_ddp --trainer.devices=2`` trained the full model in full precision on DDP, without its
quantization or LoRA, and said nothing. A change of ``class_path`` keeps the ``init_args`` the new class takes
(jsonargparse's rule for ``--model=OtherClass``), so this package's names are passed on as that change. A later
config file that names one of this package's strategies is refused with the class form that keeps them; one of
Lightning's names (``auto`` for a plain reference run, ``ddp``) is a choice, said in a warning.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from pl_lowprec.cli.arguments import options, read_config
from pl_lowprec.strategy_names import STRATEGY_NAMES, registered_strategy


def class_change(name: str) -> tuple[str, dict[str, Any]] | None:
    """This package's strategy ``name`` as the public class path and the arguments its registration gives
    (``lowprec_ddp_spawn``: ``start_method='spawn'``); ``None`` for any other name."""
    registered = registered_strategy(name) if name in STRATEGY_NAMES else None
    if registered is None:
        return None
    strategy_class, arguments = registered
    return f"pl_lowprec.{strategy_class.__name__}", arguments


def strategy_names_as_classes(cli_args: list[str]) -> list[str]:
    """``cli_args`` with ``--trainer.strategy NAME`` (a name of this package's) given as a change of ``class_path``,
    which keeps the strategy arguments set before it. A later ``--config`` file naming one of this package's
    strategies over them is refused; one of Lightning's names (``auto``, ``ddp``), a choice to run without this
    package's strategy, is said in a warning."""
    passed: list[str] = []
    strategy: Any = None  # trainer.strategy as the arguments so far set it
    for option in options(cli_args):
        if option.name == "--config":
            strategy = _after_config(strategy, option.value)
        elif option.name == "--trainer.strategy" and (change := class_change(option.value)) is not None:
            class_path, arguments = change
            passed += [f"--trainer.strategy.class_path={class_path}"]
            passed += [f"--trainer.strategy.init_args.{key}={value}" for key, value in arguments.items()]
            continue
        elif option.name == "--trainer.strategy.help" and (change := class_change(option.value)) is not None:
            passed += [f"--trainer.strategy.help={change[0]}"]  # jsonargparse's help takes a class, not a name
            continue
        elif option.name == "--trainer.strategy":
            _warn_dropped_arguments(strategy, option.value, f"--trainer.strategy={option.value}")
            strategy = option.value
        passed += option.given
    return passed


def _after_config(strategy: Any, config: str) -> Any:
    """The strategy once ``config`` is read: its own where it sets one, a change of class keeping the arguments
    before it; one of this package's names over arguments refused, one of Lightning's warned of."""
    given, where = _strategy_in(config)
    change = class_change(given) if isinstance(given, str) else None
    if change is not None:
        message = _dropped_arguments(strategy, given, f"{where} sets trainer.strategy: {given}, which")
        if message is not None:
            class_path, arguments = change
            listed = ", ".join(f"{key}: {value}" for key, value in arguments.items())
            init_args = f", init_args: {{{listed}}}" if listed else ""
            raise ValueError(
                f"{message} To keep them, write it as a class, which keeps the arguments it takes: strategy:"
                f" {{class_path: {class_path}{init_args}}}; to drop them, remove the strategy from the earlier"
                " config."
            )
    elif isinstance(given, str):
        _warn_dropped_arguments(strategy, given, f"{where} sets trainer.strategy: {given}, which")
    if given is None:
        return strategy
    if isinstance(strategy, dict) and isinstance(given, dict):
        before = strategy.get("init_args") or {}
        return {**given, "init_args": {**before, **(given.get("init_args") or {})}}
    return given


def _warn_dropped_arguments(strategy: Any, name: str, source: str) -> None:
    """A warning where Lightning's strategy ``name`` replaces this package's with arguments: deliberate for a plain
    reference run (``strategy: auto``), a mistake for QLoRA on several devices (``ddp``)."""
    if name != "auto" and name not in StrategyRegistry:
        return  # not a strategy name at all: refused later, with the names that are
    message = _dropped_arguments(strategy, name, source)
    if message is not None:
        rank_zero_warn(
            f"{message} For the same settings on several devices, name one of this package's strategies, which"
            " keeps them: --trainer.strategy=lowprec_ddp (or lowprec_fsdp, lowprec_ddp_spawn, lowprec; in a"
            " config file, strategy: {class_path: pl_lowprec.LowPrecisionDDPStrategy})."
        )


def _dropped_arguments(strategy: Any, name: str, source: str) -> str | None:
    """What ``name`` from ``source`` drops of this package's ``strategy``; ``None`` where it drops nothing."""
    if not isinstance(strategy, dict) or not str(strategy.get("class_path", "")).startswith("pl_lowprec."):
        return None
    arguments = {key: value for key, value in (strategy.get("init_args") or {}).items() if value is not None}
    if not arguments:
        return None
    class_name = str(strategy["class_path"]).rsplit(".", 1)[-1]
    listed = ", ".join(f"{key}={value!r}" for key, value in arguments.items())
    return (
        f"{source} replaces the strategy set before it, {class_name}({listed}), by {name!r}, which takes none of"
        " those arguments: this run trains without them."
    )


def _strategy_in(config: str) -> tuple[Any, str]:
    """``trainer.strategy`` as a ``--config`` file (or inline YAML) sets it, top level or under ``fit`` (``None``
    where it sets none), and where it comes from, in words."""
    fields, where = read_config(config)
    if not isinstance(fields, dict):
        return None, where  # a missing file: the parser refuses it
    strategy = None
    for section in (fields, fields.get("fit")):
        trainer = section.get("trainer") if isinstance(section, dict) else None
        if isinstance(trainer, dict) and trainer.get("strategy") is not None:
            strategy = trainer["strategy"]
    return strategy, where
