"""A ``--config`` that is not YAML (a key indented one space too far, an unclosed inline mapping, a binary file)
is refused by every subcommand that reads configs as one paragraph naming the line at fault, exit status 2.

It used to end in a 50-70 line traceback with exit status 1: the package's own reader of the configs
(``strategy_override``, run before jsonargparse sees them) parsed the file first. The commands run in-process,
the user's way (``pl_lowprec.cli.main``).
"""

from __future__ import annotations

import pytest

from pl_lowprec.cli import main

COMMANDS = {  # subcommand: its other required arguments
    "fit": [],
    "estimate": [],
    "plan": ["--memory=1GiB", "--out={tmp}/plan.yaml"],
    "export": ["--ckpt_path={tmp}/last.ckpt", "--out={tmp}/adapter"],
}


def refusal(capsys, args: list[str]) -> str:
    with pytest.raises(SystemExit) as exited:
        main(args)
    out, err = capsys.readouterr()
    assert exited.value.code == 2, out + err
    assert out == "" and "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("subcommand", list(COMMANDS))
def test_a_config_file_that_is_not_yaml_is_one_paragraph_with_the_line(capsys, tmp_path, subcommand):
    broken = tmp_path / "broken.yaml"
    broken.write_text("trainer:\n  max_steps: 2\n   devices: 1\n")
    others = [arg.format(tmp=tmp_path) for arg in COMMANDS[subcommand]]
    said = refusal(capsys, [subcommand, f"--config={broken}", *others])
    assert f"--config {broken} is not valid YAML: mapping values are not allowed here" in said, said
    assert "at line 3, column 11 ('devices: 1')" in said, said
    assert {path.name for path in tmp_path.iterdir()} == {"broken.yaml"}, "nothing is written"


def test_inline_yaml_and_a_binary_file_are_refused_alike(capsys, tmp_path):
    said = refusal(capsys, ["fit", "--config=trainer: {max_steps: 2"])
    assert "the --config given inline is not valid YAML: expected ',' or '}'" in said, said
    binary = tmp_path / "weights.yaml"
    binary.write_bytes(bytes([0xDA, 0x00, 0xFF, 0x10]))
    said = refusal(capsys, ["fit", f"--config={binary}"])
    assert f"--config {binary} is not a YAML file (UnicodeDecodeError" in said, said


def test_a_long_broken_inline_config_is_one_paragraph(capsys):
    """Inline YAML longer than a file name may be (255 bytes) is not taken for a path: asking whether it names a
    file raised ``OSError: [Errno 36] File name too long``, a traceback."""
    keys = ", ".join(f"key_{index}: {index}" for index in range(50))
    given = f"trainer: {{max_steps: 2, {keys}"  # unclosed
    assert len(given) > 255
    said = refusal(capsys, ["fit", f"--config={given}"])
    assert "the --config given inline is not valid YAML: expected ',' or '}'" in said, said
    assert f"at line 1, column {len(given) + 1} ({given!r})" in said, said


def test_a_config_is_parsed_once(capsys, monkeypatch, tmp_path):
    """Each ``--config`` is read once before the subcommand, not once per check."""
    import yaml

    parsed: list[str] = []
    safe_load = yaml.safe_load
    monkeypatch.setattr(yaml, "safe_load", lambda text: parsed.append(text) or safe_load(text))
    broken = tmp_path / "broken.yaml"
    broken.write_text("trainer:\n  max_steps: 2\n   devices: 1\n")
    refusal(capsys, ["fit", f"--config={broken}", "--config=trainer: {max_steps: 3}"])
    assert len(parsed) == 2, parsed


def _parses_of(monkeypatch, config) -> list[str]:
    """Every YAML parse, from now on, of ``config``'s text or of the inline YAML the rebuild makes of it (which
    names it on its first line)."""
    import yaml

    parsed: list[str] = []
    safe_load = yaml.safe_load

    def counting(text, *args, **kwargs):
        if isinstance(text, str) and (str(config) in text or text == config.read_text()):
            parsed.append(text)
        return safe_load(text, *args, **kwargs)

    monkeypatch.setattr(yaml, "safe_load", counting)
    return parsed


def test_a_config_that_reads_is_parsed_once_by_the_package(capsys, monkeypatch, tmp_path):
    """The checks parse each ``--config`` once, and the later readers (the strategy override, plan's merge, the
    rebuild's inline copy) take that parse: fit parsed it twice, plan four times (jsonargparse reads it with its own
    loader, not counted here)."""
    from loading_helpers import save_pretrained_dir, write_prompt_completion

    model = save_pretrained_dir(tmp_path / "model")
    config = tmp_path / "run.yaml"
    config.write_text(
        "trainer: {accelerator: cpu, precision: 32-true, strategy: {class_path: pl_lowprec.LowPrecisionStrategy,"
        " init_args: {lora: {r: 4, target_modules: all-linear}}}}\n"
        f"model: {{class_path: pl_lowprec.models.CausalLM, init_args: {{pretrained: {model}}}}}\n"
        f"data: {{class_path: pl_lowprec.data.TextDataModule, init_args: {{train_files:"
        f" {write_prompt_completion(tmp_path / 'pc.jsonl')}, tokenizer: {model}, seq_len: 32, batch_size: 2}}}}\n"
    )
    parsed = _parses_of(monkeypatch, config)
    with pytest.raises(SystemExit) as exited:
        main(["fit", f"--config={config}", "--print_config"])
    assert exited.value.code == 0 and len(parsed) == 1, parsed
    parsed.clear()
    main(["plan", f"--config={config}", "--memory=1GiB", f"--out={tmp_path / 'planned.yaml'}"])
    assert (tmp_path / "planned.yaml").is_file() and len(parsed) == 1, parsed
    capsys.readouterr()
