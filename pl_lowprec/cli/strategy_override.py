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

from pl_lowprec.cli.arguments import config_values, options, read_config

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
    which keeps the config's strategy arguments; refuses a name of Lightning's that would drop them."""
    passed: list[str] = []
    for option in options(cli_args):
        if option.name != "--trainer.strategy":
            passed += option.given
        elif option.value in CLASS_OF_NAME:
            class_path, more = CLASS_OF_NAME[option.value]
            passed += [f"--trainer.strategy.class_path={class_path}", *more]
        else:
            _refuse_dropped_arguments(option.value, cli_args)
            passed += option.given
    return passed


def _refuse_dropped_arguments(name: str, cli_args: list[str]) -> None:
    if name != "auto" and name not in StrategyRegistry:
        return  # not a strategy name at all: refused later, with the names that are
    strategy = _configured_strategy(cli_args)
    if not isinstance(strategy, dict) or not str(strategy.get("class_path", "")).startswith("pl_lowprec."):
        return
    arguments = {key: value for key, value in (strategy.get("init_args") or {}).items() if value is not None}
    if not arguments:
        return
    class_name = str(strategy["class_path"]).rsplit(".", 1)[-1]
    listed = ", ".join(f"{key}={value!r}" for key, value in arguments.items())
    raise ValueError(
        f"--trainer.strategy={name} replaces the config's strategy, {class_name}({listed}), by {name!r} without"
        " any of those arguments: the run would train without them. For the same settings on several devices, name"
        " one of this package's strategies, which keeps them: --trainer.strategy=lowprec_ddp (or lowprec_fsdp,"
        " lowprec_ddp_spawn, lowprec); to change the class and keep what it takes,"
        " --trainer.strategy.class_path=CLASS; to drop them, remove the strategy from the config."
    )


def _configured_strategy(cli_args: list[str]) -> Any:
    """``trainer.strategy`` as the ``--config`` files set it (the last that does), top level or under ``fit``."""
    strategy = None
    for value in config_values(cli_args):
        fields, _ = read_config(value)
        if not isinstance(fields, dict):
            continue  # a missing file: the parser refuses it
        for section in (fields, fields.get("fit")):
            trainer = section.get("trainer") if isinstance(section, dict) else None
            if isinstance(trainer, dict) and "strategy" in trainer:
                strategy = trainer["strategy"]
    return strategy
