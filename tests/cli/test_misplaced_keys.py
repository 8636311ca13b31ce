"""A config key given in the wrong section (``trainer: {quantization: nf4}``, ``--trainer.lr``, ``lora`` under the
model) is refused with the section that takes it, as one paragraph and exit status 2, before anything is built.

jsonargparse's own refusal ("Subcommand 'fit' does not accept option 'trainer.quantization'", "unrecognized
arguments: --trainer.lr 0.1") said the key was refused but not where it goes. The CLI runs in-process on the
quick-start config, the user's way (``pl_lowprec.cli.main`` with the command's arguments).
"""

from __future__ import annotations

import pytest

from pl_lowprec.cli import main

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

QUICKSTART = "configs/quickstart.yaml"
STRATEGY_HOME = ["trainer.strategy.init_args", "--trainer.strategy.{name}=VALUE"]

CASES = [  # (the misplaced setting: a --config YAML or a command-line option, the key's name, where it belongs)
    ("--config=trainer: {quantization: nf4}", "quantization", [*STRATEGY_HOME, "not of trainer."]),
    ("--config=quantization: nf4", "quantization", [*STRATEGY_HOME, "not of the top level"]),
    ("--trainer.quantization=nf4", "quantization", STRATEGY_HOME),
    ("--config=model: {init_args: {lora: {r: 4}}}", "lora", [*STRATEGY_HOME, "not of model"]),
    ("--trainer.lr=0.1", "lr", ["the model", "model.init_args", "--model.lr=VALUE"]),
    ("--model.init_args.max_steps=3", "max_steps", ["the Trainer", "--trainer.max_steps=VALUE"]),
    ("--trainer.loss_scale=dynamic", "loss_scale", ["precision plugin", "trainer.plugins[].init_args"]),
]


@pytest.mark.parametrize(("argument", "name", "named"), CASES, ids=[case[0] for case in CASES])
def test_a_key_in_the_wrong_section_is_refused_with_where_it_belongs(capsys, tmp_path, argument, name, named):
    args = ["fit", f"--config={QUICKSTART}", f"--trainer.default_root_dir={tmp_path}", argument]
    with pytest.raises(SystemExit) as exited:
        main(args)
    out, err = capsys.readouterr()
    assert exited.value.code == 2, out + err
    assert "Traceback" not in out + err
    assert out == ""
    paragraph = next(line for line in err.splitlines() if "error: " in line)
    assert f"`{name}` is an argument of" in paragraph, paragraph
    for part in named:
        assert part.format(name=name) in paragraph, paragraph
    assert not list(tmp_path.iterdir()), "nothing is written before the refusal"


def test_a_key_refused_in_a_group_is_placed_in_that_group(capsys):
    """With ``--print_config`` jsonargparse words the refusal "Group 'trainer' does not accept option
    'quantization'", naming the section apart from the key; it was read as a key of the top level."""
    with pytest.raises(SystemExit) as exited:
        main(["fit", f"--config={QUICKSTART}", "--print_config", "--config=trainer: {quantization: nf4}"])
    out, err = capsys.readouterr()
    assert exited.value.code == 2 and out == "", out + err
    paragraph = next(line for line in err.splitlines() if "error: " in line)
    assert "Group 'trainer' does not accept option 'quantization'" in paragraph, paragraph
    assert "`quantization` is an argument of the strategy" in paragraph and "not of trainer." in paragraph, paragraph
