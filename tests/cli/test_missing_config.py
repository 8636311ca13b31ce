"""A ``--config`` file that does not exist is refused by every subcommand that reads one, as one paragraph with
the nearest config file's name, exit status 2, before anything is built.

jsonargparse said 'Parser key "config": File does not exist: ...' for fit, and the package's own subcommands
said the same through the rebuild. The commands run in-process, the user's way (``pl_lowprec.cli.main``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pl_lowprec.cli import main

ROOT = Path(__file__).resolve().parents[2]

COMMANDS = {  # subcommand: its other required arguments
    "fit": [],
    "validate": [],
    "estimate": [],
    "plan": ["--memory=1GiB", "--out={tmp}/plan.yaml"],
    "export": ["--ckpt_path={tmp}/last.ckpt", "--out={tmp}/adapter"],
}


@pytest.mark.parametrize("subcommand", list(COMMANDS))
@pytest.mark.parametrize(
    ("given", "said"),
    [
        ("configs/quickstrat.yaml", "Did you mean configs/quickstart.yaml?"),  # a typo beside the repository's
        ("quickstart.yaml", "Did you mean configs/quickstart.yaml?"),  # a bare name: configs/ is searched
        ("configs/nothing_like_it.yaml", "does not exist (relative to"),
    ],
)
def test_a_missing_config_file_is_one_paragraph_naming_the_nearest(
    capsys, monkeypatch, tmp_path, subcommand, given, said
):
    monkeypatch.chdir(ROOT)
    others = [arg.format(tmp=tmp_path) for arg in COMMANDS[subcommand]]
    with pytest.raises(SystemExit) as exited:
        main([subcommand, f"--config={given}", *others])
    out, err = capsys.readouterr()
    assert exited.value.code == 2, out + err
    assert out == "" and "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert f"--config {given} does not exist" in lines[0] and said in lines[0], lines[0]
    assert "Parser key" not in lines[0]
    if "nothing_like_it" in given:
        assert "Did you mean" not in lines[0]
    assert not list(tmp_path.iterdir()), "nothing is written before the refusal"


def test_inline_yaml_is_not_taken_for_a_missing_file(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as exited:
        main(["fit", "--config=configs/quickstart.yaml", "--config=trainer: {max_steps: 3}", "--print_config"])
    assert exited.value.code == 0
    assert "max_steps: 3" in capsys.readouterr().out
