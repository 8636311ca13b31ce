"""``--trainer.strategy=lowprec_ddp`` over a config whose strategy has arguments keeps them.

Lightning types ``Trainer(strategy=...)`` as ``str | Strategy``, so jsonargparse reads a strategy name as a plain
string that replaces the config's ``class_path`` and ``init_args`` whole: ``pl-lowprec fit --config qlora.yaml
--trainer.strategy=lowprec_ddp --trainer.devices=2`` trained the full model in full precision on DDP, without its
quantization or LoRA, and said nothing. A change of ``class_path`` keeps the ``init_args`` the new class takes
(jsonargparse's rule for ``--model=OtherClass``), so this package's names are passed on as that change. One of
Lightning's names (``ddp``, ``fsdp``, ``auto``) over this package's strategy with arguments is refused: it would
drop them.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

from pl_lowprec.cli.arguments import options, read_config

CLASS_OF_NAME: dict[str, tuple[str, tuple[str, ...]]] = {
    "lowprec": ("pl_lowprec.LowPrecisionStrategy", ()),
    "lowprec_ddp": ("pl_lowprec.LowPrecisionDDPStrategy", ("--trainer.strategy.init_args.start_method=popen",)),
    "lowprec_ddp_spawn": (
        "pl_lowprec.LowPrecisionDDPStrategy",
        ("--trainer.strategy.init_args.start_method=spawn",),
    ),
    "lowprec_fsdp": ("pl_lowprec.LowPrecisionFSDPStrategy", ()),
}


def strategy_names_as_classes(cli_args: list[str]) -> list[str]:
    """``cli_args`` with ``--trainer.strategy NAME`` (a name of this package's) given as a change of ``class_path``,
    which keeps the strategy arguments set before it; refuses a name (a later ``--config`` file's, or one of
    Lightning's on the command line) that would drop them."""
    passed: list[str] = []
    strategy: Any = None  # trainer.strategy as the arguments so far set it
    for option in options(cli_args):
        if option.name == "--config":
            strategy = _after_config(strategy, option.value)
        elif option.name == "--trainer.strategy" and option.value in CLASS_OF_NAME:
            class_path, more = CLASS_OF_NAME[option.value]
            passed += [f"--trainer.strategy.class_path={class_path}", *more]
            continue
        elif option.name == "--trainer.strategy":
            _refuse_dropped_arguments(strategy, option.value, f"--trainer.strategy={option.value} replaces")
            strategy = option.value
        passed += option.given
    return passed


def _after_config(strategy: Any, config: str) -> Any:
    """The strategy once ``config`` is read: its own where it sets one (a name over arguments refused), a change of
    class keeping the arguments before it."""
    given = _strategy_in(config)
    if given is None:
        return strategy
    if isinstance(given, str):
        class_path = CLASS_OF_NAME.get(given, ("pl_lowprec.LowPrecisionDDPStrategy",))[0]
        spawn = ", init_args: {start_method: spawn}" if given.endswith("_spawn") else ""
        keep = f"write it as a class, which keeps the arguments it takes: strategy: {{class_path: {class_path}{spawn}}}"
        _refuse_dropped_arguments(strategy, given, f"{config} sets trainer.strategy: {given}, which replaces", keep)
        return given
    if isinstance(strategy, dict) and isinstance(given, dict):
        before = strategy.get("init_args") or {}
        return {**given, "init_args": {**before, **(given.get("init_args") or {})}}
    return given


def _refuse_dropped_arguments(strategy: Any, name: str, replaces: str, keep: str | None = None) -> None:
    """Refuse ``name`` over this package's ``strategy`` with arguments; ``replaces`` says where ``name`` comes from."""
    if name != "auto" and name not in StrategyRegistry and name not in CLASS_OF_NAME:
        return  # not a strategy name at all: refused later, with the names that are
    if not isinstance(strategy, dict) or not str(strategy.get("class_path", "")).startswith("pl_lowprec."):
        return
    arguments = {key: value for key, value in (strategy.get("init_args") or {}).items() if value is not None}
    if not arguments:
        return
    class_name = str(strategy["class_path"]).rsplit(".", 1)[-1]
    listed = ", ".join(f"{key}={value!r}" for key, value in arguments.items())
    keep = keep or (
        "name one of this package's strategies, which keeps them: --trainer.strategy=lowprec_ddp (or lowprec_fsdp,"
        " lowprec_ddp_spawn, lowprec); to change the class and keep what it takes, --trainer.strategy.class_path=CLASS"
    )
    raise ValueError(
        f"{replaces} the strategy set before it, {class_name}({listed}), by {name!r} without any of those"
        f" arguments: the run would train without them. For the same settings (on several devices too), {keep};"
        " to drop them, remove the strategy from the config."
    )


def _strategy_in(config: str) -> Any:
    """``trainer.strategy`` as a ``--config`` file (or inline YAML) sets it, top level or under ``fit``; ``None``
    where it sets none."""
    fields, _ = read_config(config)
    if not isinstance(fields, dict):
        return None  # a missing file: the parser refuses it
    strategy = None
    for section in (fields, fields.get("fit")):
        trainer = section.get("trainer") if isinstance(section, dict) else None
        if isinstance(trainer, dict) and trainer.get("strategy") is not None:
            strategy = trainer["strategy"]
    return strategy
