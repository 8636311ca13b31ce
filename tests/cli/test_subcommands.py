"""The top-level help and the refusal of a missing or unknown subcommand name every subcommand, the package's own
too: LightningCLI's listed only fit, validate, test and predict ("invalid choice: 'estimat' (choose from 'fit',
...)"), and the usage line of ``python -m pl_lowprec`` read ``__main__.py``."""

from __future__ import annotations

import sys

import pytest

from pl_lowprec.cli import main
from pl_lowprec.cli.subcommands import LIGHTNING_SUBCOMMANDS, OWN_SUBCOMMANDS, description, subcommand_lines

ALL = [*LIGHTNING_SUBCOMMANDS, *OWN_SUBCOMMANDS]


def refused(capsys, args: list[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        main(args)
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize(
    ("given", "start"),
    [
        ([], "pl-lowprec: error: a subcommand is needed"),
        (
            ["estimat", "--config", "x.yaml"],
            "pl-lowprec: error: 'estimat' is not a subcommand; did you mean 'estimate'?",
        ),
        (["fitt"], "pl-lowprec: error: 'fitt' is not a subcommand; did you mean 'fit'?"),
        (["train.yaml"], "pl-lowprec: error: 'train.yaml' is not a subcommand. The subcommands:"),
    ],
)
def test_a_missing_or_unknown_subcommand_is_refused_with_every_name(capsys, given, start):
    said = refused(capsys, given)
    assert said.startswith(start), said
    assert f"The subcommands: {', '.join(ALL)}." in said


def test_the_help_names_every_subcommand_under_the_console_scripts_name(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", ["__main__.py"])  # as python -m pl_lowprec runs it
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    printed = capsys.readouterr().out
    text = " ".join(printed.split())
    listed = " ".join(printed.split("Available subcommands:", 1)[1].split())  # LightningCLI's block: its four only
    expected = [f"{name} {line}" for name, line in subcommand_lines().items()]
    assert listed == "(required) " + " ".join(expected), listed
    assert "Train from a config." in listed and "It's separated from fit" not in listed  # Lightning's, cut short
    assert text.startswith(f"usage: pl-lowprec [-c CONFIG] {{{','.join(ALL)}}} ...")  # LightningCLI's, all nine


@pytest.mark.parametrize("name", OWN_SUBCOMMANDS)
def test_each_subcommands_help_opens_with_its_line(capsys, name):
    with pytest.raises(SystemExit) as exited:
        main([name, "--help"])
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert text.startswith(f"usage: pl-lowprec {name} ") and f" {description(name)} " in text


def test_each_commands_help_shows_its_examples_and_the_config_arguments(capsys):
    for name, said in (
        ("export", "go to the config"),
        ("generate", "restored through its config"),
        ("estimate", "Arguments the estimate does not know (`--model.pretrained DIR`"),
        ("plan", "Arguments the plan does not know (`--model.pretrained DIR`"),
    ):
        with pytest.raises(SystemExit):
            main([name, "--help"])
        text = capsys.readouterr().out
        assert f"examples:\n    pl-lowprec {name} --" in text and said in " ".join(text.split())


def test_build_cli_refuses_the_packages_own_subcommands(capsys):
    """They are in LightningCLI's parser for its help only (main runs them before it is built): build_cli of one
    is one paragraph, not a KeyError from LightningCLI looking for its parser."""
    from pl_lowprec.cli import build_cli

    with pytest.raises(SystemExit) as exited:
        build_cli(["estimate", "--config", "configs/quickstart.yaml"])
    assert exited.value.code == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and err.count("\n") == 1, err
    assert "estimate is one of pl-lowprec's own subcommands" in err and "pl_lowprec.cli.main(['estimate'" in err
