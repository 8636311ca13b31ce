"""``pl-lowprec fit --trainer.strategy.help CLASS`` documents every argument of each strategy: the model
arguments (declared once, on ``TransformArguments``) and the strategy's own."""

import dataclasses
import inspect
import re

import pytest

from pl_lowprec.cli import main
from pl_lowprec.strategies import LowPrecisionDDPStrategy, LowPrecisionFSDPStrategy, LowPrecisionStrategy
from pl_lowprec.strategies.transform_args import TransformArguments
from pl_lowprec.transforms.config import TransformConfig

MODEL_ARGUMENTS = [f.name for f in dataclasses.fields(TransformConfig) if f.init]
GUARD_ARGUMENTS = ["memory_budget"]  # the mixin's own: checked before the transform, not part of it


def _own_arguments(strategy: type) -> list[str]:
    """The strategy's own ``__init__`` parameters (none when it inherits the mixin's)."""
    if "__init__" not in vars(strategy):
        return []
    parameters = inspect.signature(strategy.__init__).parameters.values()
    return [p.name for p in parameters if p.name != "self" and p.kind is not p.VAR_KEYWORD]


def _help_by_option(text: str) -> dict[str, str]:
    """``{argument: its help text}``; the help is what comes before jsonargparse's ``(type: ...)``."""
    blocks = re.split(r"\n  (?=--trainer\.strategy\.)", text)
    helps = {}
    for block in blocks[1:]:
        head, _, body = block.partition("\n")
        first = head.split()[0].removeprefix("--trainer.strategy.").rstrip("+,")
        on_first_line = head.split(maxsplit=1)[1] if len(head.split(maxsplit=1)) > 1 else ""
        on_first_line = re.sub(r"^[A-Z_]+(, --\S+ [A-Z_]+)?\s*", "", on_first_line) if first != "help" else ""
        described = " ".join((on_first_line + " " + body).split())
        helps[first] = described.partition("(type:")[0].strip()
    return helps


def test_the_mixin_takes_exactly_the_config_fields():
    mixin = [p for p in inspect.signature(TransformArguments.__init__).parameters if p not in ("self", "kwargs")]
    assert mixin == MODEL_ARGUMENTS + GUARD_ARGUMENTS


@pytest.mark.parametrize("strategy", [LowPrecisionStrategy, LowPrecisionDDPStrategy, LowPrecisionFSDPStrategy])
def test_fit_help_documents_every_argument(strategy, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--trainer.strategy.help", strategy.__name__])
    assert exit_info.value.code == 0
    helps = _help_by_option(capsys.readouterr().out)
    for name in MODEL_ARGUMENTS + GUARD_ARGUMENTS + _own_arguments(strategy):
        assert name in helps, f"--trainer.strategy.{name} is not in the help of {strategy.__name__}"
        assert helps[name], f"--trainer.strategy.{name} has no help text for {strategy.__name__}"
    assert "torchao_adamw8bit" in helps["optimizer"]
    assert "axolotl's ``lora_model_dir``" in helps["pretrained_adapter"]  # continuing a saved peft adapter
    assert helps["checkpoint_every_n"] == "Checkpoint only every n-th selected block: less recompute, more memory."
