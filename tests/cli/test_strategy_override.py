"""``--trainer.strategy=lowprec_ddp`` over a config keeps the config's strategy arguments; a name of Lightning's
that would drop them is refused. Jsonargparse read the name as a plain string, which replaced the QLoRA strategy
whole: the run trained the full model, unquantized, without a word."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pl_lowprec.cli import main
from pl_lowprec.cli.strategy_override import strategy_names_as_classes

QUICKSTART = str(Path(__file__).resolve().parents[2] / "configs/quickstart.yaml")


def printed_strategy(capsys, *args: str) -> dict:
    with pytest.raises(SystemExit) as printed:
        main(["fit", f"--config={QUICKSTART}", *args, "--print_config"])
    assert printed.value.code == 0
    return yaml.safe_load(capsys.readouterr().out)["trainer"]["strategy"]


@pytest.mark.parametrize(
    ("name", "class_path", "start_method"),
    [
        ("lowprec_ddp", "pl_lowprec.LowPrecisionDDPStrategy", "popen"),
        ("lowprec_ddp_spawn", "pl_lowprec.LowPrecisionDDPStrategy", "spawn"),
        ("lowprec_fsdp", "pl_lowprec.LowPrecisionFSDPStrategy", None),
    ],
)
def test_a_strategy_name_over_a_config_keeps_its_arguments(capsys, name, class_path, start_method):
    strategy = printed_strategy(capsys, f"--trainer.strategy={name}", "--trainer.devices=2")
    assert strategy["class_path"] == class_path
    arguments = strategy["init_args"]
    assert arguments["quantization"] == "nf4-dq"  # the quick-start's, kept
    assert (arguments["lora"]["r"], arguments["lora"]["lora_alpha"]) == (8, 16)
    assert arguments.get("start_method") == start_method


def test_the_name_as_two_arguments_and_other_arguments_pass_unchanged():
    args = ["fit", "--config", "a.yaml", "--trainer.strategy", "lowprec", "--trainer.fast_dev_run"]
    assert strategy_names_as_classes(args) == [
        "fit",
        "--config",
        "a.yaml",
        "--trainer.strategy.class_path=pl_lowprec.LowPrecisionStrategy",
        "--trainer.fast_dev_run",
    ]
    plain = ["fit", "--trainer.strategy=ddp", "--trainer.devices", "2"]  # no config strategy to drop
    assert strategy_names_as_classes(plain) == plain


@pytest.mark.parametrize("name", ["ddp", "auto"])
def test_a_lightning_name_over_this_packages_strategy_is_a_choice_said_in_a_warning(name):
    """``strategy: auto`` runs a plain reference; ``ddp`` may be a slip for ``lowprec_ddp``: both run, told."""
    args = ["fit", f"--config={QUICKSTART}", f"--trainer.strategy={name}"]
    with pytest.warns(UserWarning) as warned:
        assert strategy_names_as_classes(args) == args
    said = str(warned[0].message)
    assert said.startswith(f"--trainer.strategy={name} replaces the strategy set before it, LowPrecisionStrategy(")
    assert "quantization='nf4-dq'" in said and "this run trains without them" in said
    assert "--trainer.strategy=lowprec_ddp" in said
    inline = yaml.safe_dump({"trainer": {"strategy": name, "plugins": []}})  # a long inline YAML, as tests give
    with pytest.warns(UserWarning, match=rf"the --config given inline sets trainer.strategy: {name}, which replaces"):
        strategy_names_as_classes(["fit", f"--config={QUICKSTART}", f"--config={inline * 20}"])


def test_a_misspelled_name_is_left_to_the_name_check():
    misspelled = ["fit", f"--config={QUICKSTART}", "--trainer.strategy=lowprec_fsdpp"]  # "Did you mean" later
    assert strategy_names_as_classes(misspelled) == misspelled


def test_a_second_config_naming_a_strategy_is_refused_and_one_naming_its_class_keeps_the_arguments(capsys, tmp_path):
    """``--config base.yaml --config two.yaml`` where two.yaml says ``strategy: lowprec_ddp`` dropped base.yaml's
    QLoRA settings the same way; as a class it keeps them."""
    by_name, by_class = tmp_path / "by_name.yaml", tmp_path / "by_class.yaml"
    by_name.write_text(yaml.safe_dump({"trainer": {"devices": 2, "strategy": "lowprec_ddp_spawn"}}))
    by_class.write_text(
        yaml.safe_dump({"trainer": {"devices": 2, "strategy": {"class_path": "pl_lowprec.LowPrecisionDDPStrategy"}}})
    )
    with pytest.raises(ValueError, match=r"by_name.yaml sets trainer.strategy: lowprec_ddp_spawn, which replaces") as e:
        strategy_names_as_classes(["fit", f"--config={QUICKSTART}", f"--config={by_name}"])
    assert "quantization='nf4-dq'" in str(e.value)
    assert "strategy: {class_path: pl_lowprec.LowPrecisionDDPStrategy, init_args: {start_method: spawn}}" in str(
        e.value
    )
    with pytest.raises(SystemExit):  # estimate and plan read the files as inline YAML: still named by their path
        main(["estimate", f"--config={QUICKSTART}", f"--config={by_name}"])
    assert f"error: {by_name} sets trainer.strategy: lowprec_ddp_spawn, which replaces" in capsys.readouterr().err
    strategy = printed_strategy(capsys, f"--config={by_class}")
    assert strategy["class_path"] == "pl_lowprec.LowPrecisionDDPStrategy"
    assert strategy["init_args"]["quantization"] == "nf4-dq"
    # a later file's class over an earlier name leaves nothing to drop
    assert strategy_names_as_classes([f"--config={by_name}", f"--config={QUICKSTART}"]) == [
        f"--config={by_name}",
        f"--config={QUICKSTART}",
    ]


@pytest.mark.parametrize(("name", "option"), [("lowprec", "quantization"), ("lowprec_fsdp", "shard_modules")])
def test_strategy_help_takes_the_strategy_name_as_trainer_strategy_does(capsys, name, option):
    """``--trainer.strategy.help lowprec`` was refused ("Expected a dot import path string"): jsonargparse's help
    takes a class, while ``--trainer.strategy`` takes the registered name."""
    with pytest.raises(SystemExit) as exited:
        main(["fit", f"--trainer.strategy.help={name}"])
    out, err = capsys.readouterr()
    assert exited.value.code == 0, err
    assert f"--trainer.strategy.{option}" in out and "Traceback" not in err
