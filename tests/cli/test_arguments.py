"""Reading a command line's ``--config`` files and overrides: one reader for plan's merge, the rebuild and the
files ``--out`` must spare."""

from pl_lowprec.cli.arguments import config_values, options, read_config
from pl_lowprec.cli.plan import merged_fields
from pl_lowprec.cli.rebuild import config_files


def test_each_form_of_an_argument_reads_as_lightning_cli_reads_it():
    args = ["--config", "a.yaml", "--trainer.max_steps=3", "--model.lr", "0.1", "--print_flag", "--config=b.yaml", "x"]
    read = [(o.name, o.value, o.given) for o in options(args)]
    assert read == [
        ("--config", "a.yaml", ("--config", "a.yaml")),
        ("--trainer.max_steps", "3", ("--trainer.max_steps=3",)),
        ("--model.lr", "0.1", ("--model.lr", "0.1")),
        ("--print_flag", "true", ("--print_flag",)),  # the next argument is an option, not its value
        ("--config", "b.yaml", ("--config=b.yaml",)),
        ("", "x", ("x",)),
    ]
    assert [a for o in options(args) for a in o.given] == args  # nothing lost or reordered
    assert config_values(args) == ["a.yaml", "b.yaml"]
    assert list(config_files(args)) == ["config (1 of 2)", "config (2 of 2)"]


def test_configs_and_overrides_merge_in_order_files_or_inline(tmp_path):
    first = tmp_path / "first.yaml"
    first.write_text("trainer:\n  max_steps: 5\n  precision: bf16-mixed\nmodel:\n  class_path: a.B\n")
    assert read_config(str(first)) == (
        {"trainer": {"max_steps": 5, "precision": "bf16-mixed"}, "model": {"class_path": "a.B"}},
        str(first),
    )
    args = ["--config", str(first), "--trainer.fast_dev_run", "--config", "trainer: {max_steps: 7}", "--model.lr=0.1"]
    assert merged_fields(args) == {
        "trainer": {"max_steps": 7, "precision": "bf16-mixed", "fast_dev_run": True},
        "model": {"class_path": "a.B", "init_args": {"lr": 0.1}},
    }
