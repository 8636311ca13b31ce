"""``pl-lowprec fit --help`` (and validate/test/predict) names this package's strategies and precision plugin and
the commands that list their arguments: LightningCLI's page shows ``--trainer.strategy`` and ``--trainer.plugins``
as class paths only, so quantization, lora, memory_saving, loss_scale and the names ``lowprec``/``lowprec_ddp``/
``lowprec_fsdp`` were nowhere on it. Each command it names is run and lists those arguments."""

from __future__ import annotations

import re

import pytest

from pl_lowprec.cli import main


def printed(capsys, args: list[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        main(args)
    out, err = capsys.readouterr()
    assert exited.value.code == 0, err
    return " ".join(out.split())  # the help wraps lines


@pytest.mark.parametrize("subcommand", ["fit", "validate"])
def test_help_names_the_strategies_and_the_commands_listing_their_arguments(capsys, subcommand):
    page = printed(capsys, [subcommand, "--help"])
    assert "--trainer.strategy takes lowprec, lowprec_ddp, lowprec_ddp_spawn, lowprec_fsdp" in page, page[-800:]
    named = re.findall(r"`(pl-lowprec [^`]+)`", page.replace("pl- lowprec", "pl-lowprec"))
    assert f"pl-lowprec {subcommand} --trainer.strategy.help lowprec" in named, named
    assert f"pl-lowprec {subcommand} --trainer.plugins.help AMPPrecision" in named, named
    if subcommand == "fit":  # what they list
        strategy = printed(capsys, ["fit", "--trainer.strategy.help", "lowprec"])
        assert "--trainer.strategy.quantization" in strategy and "--trainer.strategy.lora" in strategy
        plugin = printed(capsys, ["fit", "--trainer.plugins.help", "AMPPrecision"])
        assert "--trainer.plugins.loss_scale" in plugin
