"""export and generate with --ckpt_path alone read the run's config.yaml, whose relative paths mean them from the
directory the run started in: from anywhere else they are taken from there, and said."""

import json
from pathlib import Path

import pytest
from loading_helpers import causal_lm_fit_args, save_pretrained_dir, write_prompt_completion

from pl_lowprec.cli import main
from pl_lowprec.cli.run_paths import run_started_in

pytest.importorskip("transformers")


def test_a_run_started_with_relative_paths_exports_and_generates_from_elsewhere(tmp_path, monkeypatch, capsys):
    started = tmp_path / "project"
    save_pretrained_dir(started / "models/base")
    write_prompt_completion(started / "pc.jsonl")
    monkeypatch.chdir(started)
    args = causal_lm_fit_args(Path("models/base"), Path("pc.jsonl"))  # as a user types them, relative
    lora = ["--trainer.strategy=pl_lowprec.LowPrecisionStrategy", "--trainer.strategy.lora={r: 4, lora_alpha: 8}"]
    saved = ["--trainer.callbacks+=ModelCheckpoint", "--trainer.callbacks.save_last=true"]
    main([*args, *lora, *saved, "--trainer.max_steps=1"])
    checkpoint = started / "runs/lightning_logs/version_0/checkpoints/last.ckpt"
    assert checkpoint.is_file()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()

    main(["export", f"--ckpt_path={checkpoint}", "--out=adapter"])
    printed = capsys.readouterr().out
    assert f"names paths relative to the directory the run started in, {started}" in printed
    assert f"taking models/base, pc.jsonl, models/base from {started}." in printed  # pretrained, data, tokenizer
    adapter = json.loads((elsewhere / "adapter/adapter_config.json").read_text())
    assert Path(adapter["base_model_name_or_path"]) == (started / "models/base").resolve()

    prompts = elsewhere / "prompts.txt"
    prompts.write_text("def f(x):\n")
    main(["generate", f"--ckpt_path={checkpoint}", f"--prompts={prompts}", "--out=out.jsonl", "--max_new_tokens=2"])
    assert json.loads((elsewhere / "out.jsonl").read_text().splitlines()[0])["prompt"] == "def f(x):"
    assert "names paths relative" in capsys.readouterr().out

    monkeypatch.chdir(started)  # from where it started: nothing to take from elsewhere, nothing said
    main(["export", f"--ckpt_path={checkpoint}", "--out=adapter2"])
    assert "names paths relative" not in capsys.readouterr().out


@pytest.mark.parametrize(
    ("run_dir", "root", "started"),
    [
        ("/p/runs/lightning_logs/version_3", "runs", "/p"),
        ("/p/out/exp1/lightning_logs/version_0", "./out/exp1", "/p"),
        ("/p/runs", "runs", "/p"),  # logger=False: the log directory is the root itself
        ("/p/runs/lightning_logs/version_0", "/abs/runs", None),
        ("/p/logs/version_0", "runs", None),
    ],
)
def test_where_a_run_started_follows_from_its_log_directory(run_dir, root, started):
    found = run_started_in(Path(run_dir), root)
    assert found == (Path(started) if started else None)
