"""``--trainer.strategy=lowprec_ddp`` over a config keeps the config's strategy arguments; a name of Lightning's
that would drop them is refused. Jsonargparse read the name as a plain string, which replaced the QLoRA strategy
whole: the run trained the full model, unquantized, without a word."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from pl_lowprec.cli import main
from pl_lowprec.cli.config_errors import ConfigurationError
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


def test_a_lightning_name_over_this_packages_strategy_is_refused(capsys):
    with pytest.raises(ConfigurationError):
        main(["fit", f"--config={QUICKSTART}", "--trainer.strategy=ddp", "--trainer.devices=2"])
    said = capsys.readouterr().err
    assert said.startswith("error: --trainer.strategy=ddp replaces the strategy set before it, LowPrecisionStrategy(")
    assert "quantization='nf4-dq'" in said and "--trainer.strategy=lowprec_ddp" in said
    assert said.count("\n") == 1  # one paragraph, no traceback


def test_auto_over_this_packages_strategy_is_refused_and_a_misspelling_left_to_the_name_check():
    with pytest.raises(ValueError, match=r"--trainer.strategy=auto replaces the strategy set before it"):
        strategy_names_as_classes(["fit", f"--config={QUICKSTART}", "--trainer.strategy=auto"])
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
    strategy = printed_strategy(capsys, f"--config={by_class}")
    assert strategy["class_path"] == "pl_lowprec.LowPrecisionDDPStrategy"
    assert strategy["init_args"]["quantization"] == "nf4-dq"
    # a later file's class over an earlier name leaves nothing to drop
    assert strategy_names_as_classes([f"--config={by_name}", f"--config={QUICKSTART}"]) == [
        f"--config={by_name}",
        f"--config={QUICKSTART}",
    ]
