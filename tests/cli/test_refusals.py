"""Every subcommand refuses bad input the same way: one paragraph, exit status 2, no traceback, nothing written,
and before anything loads (issue 27, "right but buried": these used to end in a traceback with exit status 1).

The commands run in-process through the console script's ``main`` (``SystemExit`` and ``capsys``); a few run as
real subprocesses to show what a shell sees. The slow step of each command (restoring a checkpoint, loading a
model) is replaced by a failure, so a refusal that came after it fails the test.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import warm_python
from gguf_helpers import fail_if_called
from loading_helpers import causal_lm_fit_args, save_pretrained_dir, write_prompt_completion

import pl_lowprec._imports as imports
from pl_lowprec.cli import main

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 6  # the paragraph, and argparse's usage where a small subcommand's own option is at fault
QUICKSTART = str(ROOT / "configs/quickstart.yaml")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-step run on the user's path (CausalLM + TextDataModule, nf4 + LoRA) with its last.ckpt and config.yaml."""
    tmp = tmp_path_factory.mktemp("refusals")
    pretrained = save_pretrained_dir(tmp / "model")
    args = [
        *causal_lm_fit_args(pretrained, write_prompt_completion(tmp / "pc.jsonl")),
        "--trainer.strategy=pl_lowprec.LowPrecisionStrategy",
        "--trainer.strategy.quantization=nf4",
        "--trainer.strategy.lora={r: 4, lora_alpha: 8}",
        "--trainer.callbacks+=ModelCheckpoint",
        "--trainer.callbacks.save_last=true",
        f"--trainer.default_root_dir={tmp / 'runs'}",
        "--trainer.max_steps=2",
    ]
    main(args)
    checkpoint = tmp / "runs/lightning_logs/version_0/checkpoints/last.ckpt"
    assert checkpoint.is_file()
    return tmp, pretrained, checkpoint


def snapshot(directory: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def refusal(capsys, args: list[str]) -> str:
    """``main(args)`` exits with status 2 and a few lines, no traceback; the error line."""
    with pytest.raises(SystemExit) as exited:
        main(args)
    out, err = capsys.readouterr()
    text = out + err
    assert exited.value.code == 2, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    lines = [line for line in text.splitlines() if line.strip()]
    assert len(lines) <= MAX_LINES, text
    errors = [line for line in lines if "error: " in line]
    assert len(errors) == 1, text
    return errors[0]


@pytest.fixture
def nothing_loads(monkeypatch):
    """The slow steps of export and generate fail the test: every refusal must come before them."""
    loads = ["pl_lowprec.cli.export.restore", "pl_lowprec.cli.generate.load_tokenizer"]
    loads += [f"pl_lowprec.cli.generate.{name}" for name in ("from_checkpoint", "from_run", "from_directory")]
    fail_if_called(monkeypatch, loads, "the model was loaded")


def _export_cases(tmp: Path, pretrained: Path, checkpoint: Path) -> list[tuple[list[str], list[str]]]:
    """(arguments, what the paragraph must say)."""
    empty, text, a_file = tmp / "empty.ckpt", tmp / "notes.ckpt", tmp / "a_file"
    empty.write_bytes(b"")
    text.write_text("not a checkpoint\n")
    a_file.write_text("keep me\n")
    data_dir, previous = tmp / "data_dir", tmp / "previous_export"
    data_dir.mkdir(exist_ok=True)
    (data_dir / "train.jsonl").write_text('{"text": "keep me"}\n')
    previous.mkdir(exist_ok=True)
    (previous / "adapter_config.json").write_text("{}")
    out = f"--out={tmp / 'new_out'}"
    ckpt = f"--ckpt_path={checkpoint}"
    return [
        ([f"--ckpt_path={tmp / 'missing.ckpt'}", out], ["missing.ckpt' does not exist"]),
        (  # a misspelled name beside the run's checkpoints: they are listed
            [f"--ckpt_path={checkpoint.parent / 'lats.ckpt'}", out],
            ["lats.ckpt' does not exist: name a Lightning checkpoint file (.ckpt). The newest there:", str(checkpoint)],
        ),
        ([f"--ckpt_path={checkpoint.parents[1]}", out], ["' is a directory: name a", "there: ", str(checkpoint)]),
        ([f"--ckpt_path={empty}", out], ["empty.ckpt' is not a Lightning checkpoint", "0 bytes"]),
        ([f"--ckpt_path={text}", out], ["notes.ckpt' is not a Lightning checkpoint"]),
        (  # both problems at once: non-empty, and --overwrite would not empty it either
            [ckpt, f"--out={data_dir}"],
            ["exists and holds train.jsonl, which no export writes", "--overwrite would not empty it either"],
        ),
        ([ckpt, f"--out={data_dir}", "--overwrite"], ["holds train.jsonl", "--overwrite will not empty it"]),
        ([ckpt, f"--out={previous}"], ["exists and is not empty: pass --overwrite"]),
        ([ckpt, f"--out={a_file}"], ["a_file' is a file; name a directory"]),
        ([ckpt, out, "--merged", "--dtype=float33"], ["--dtype 'float33' is not a dtype for merged weights"]),
        ([ckpt, out, "--merged", "--dtype=int8"], ["--dtype 'int8'", "float32, bfloat16, float16"]),
        ([ckpt, out, "--dtype=float16"], ["--dtype applies to --merged exports"]),
        ([ckpt, f"--out={pretrained}", "--merged", "--overwrite"], ["is the pretrained weights this command reads"]),
        ([ckpt, f"--out={checkpoint.parent}", "--overwrite"], ["holds the checkpoint this command reads"]),
        ([ckpt, out, "--gguf-type=q8_0"], ["--gguf-type is not an option of pl-lowprec export: did you mean --gguf_"]),
        ([ckpt, out, "--overwirte"], ["--overwirte is not an option of pl-lowprec export: did you mean --overwrite?"]),
    ]


def test_every_export_refusal_is_one_paragraph_before_the_model_loads(run, tmp_path, capsys, nothing_loads):
    tmp, pretrained, checkpoint = run
    cases = _export_cases(tmp_path, pretrained, checkpoint)
    before = snapshot(tmp) | snapshot(tmp_path)
    for args, said in cases:
        line = refusal(capsys, ["export", *args])
        assert line.startswith("pl-lowprec export: error: "), line
        for part in said:
            assert part in line, (args, line)
    assert snapshot(tmp) | snapshot(tmp_path) == before  # nothing written, emptied or left behind
    assert not (tmp_path / "new_out").exists()  # a bad --dtype leaves no empty directory


@pytest.mark.usefixtures("datasets_cache_in_tmp")  # the .csv prompts' Arrow copy
def test_every_generate_refusal_is_one_paragraph_before_the_model_loads(run, tmp_path, capsys, nothing_loads):
    tmp, _, checkpoint = run
    prompts = {
        "empty.txt": "",
        "blank.jsonl": "\n\n",
        "broken.jsonl": '{"prompt": "ok"}\n{bad json\n',
        "fields.jsonl": '{"text": "no prompt"}\n',
        "number.jsonl": '{"prompt": 1}\n',
        "turns.jsonl": '{"messages": [{"role": "user"}]}\n',
        "prompts.tsv": "prompt\nx\n",
        "columns.csv": "question\nx\n",
        "ok.txt": "def f():\n",
    }
    for name, content in prompts.items():
        (tmp_path / name).write_text(content)
    (tmp_path / "done.jsonl").write_text('{"completion": "kept"}\n')
    (tmp_path / "a_dir").mkdir()
    ggufs = tmp_path / "ggufs"  # what `export --format gguf` writes
    ggufs.mkdir()
    (ggufs / "model-q4_k_m.gguf").write_bytes(b"GGUF")
    (ggufs / "Modelfile").write_text("FROM ./model-q4_k_m.gguf\n")
    the_file = f"pass the .gguf file itself, --model '{ggufs / 'model-q4_k_m.gguf'}'."
    ok, new = f"--prompts={tmp_path / 'ok.txt'}", f"--out={tmp_path / 'new.jsonl'}"
    ckpt = f"--ckpt_path={checkpoint}"
    cases = [
        ([ckpt, f"--prompts={tmp_path / 'empty.txt'}", new], "empty.txt' holds no prompt"),
        ([ckpt, f"--prompts={tmp_path / 'blank.jsonl'}", new], "blank.jsonl' holds no prompt"),
        ([ckpt, f"--prompts={tmp_path / 'broken.jsonl'}", new], "broken.jsonl:2: not valid JSON"),
        ([ckpt, f"--prompts={tmp_path / 'fields.jsonl'}", new], "fields.jsonl:1: each record needs a 'prompt' (a"),
        ([ckpt, f"--prompts={tmp_path / 'number.jsonl'}", new], "number.jsonl:1: each record needs a 'prompt'"),
        ([ckpt, f"--prompts={tmp_path / 'turns.jsonl'}", new], "must be a list of {role, content} turns"),
        ([ckpt, f"--prompts={tmp_path / 'prompts.tsv'}", new], "prompts.tsv' is not a file this module reads"),
        ([ckpt, f"--prompts={tmp_path / 'columns.csv'}", new], "the columns ['question'], none of which holds"),
        ([ckpt, f"--prompts={tmp_path / 'columns.csv'}", "--fields={prompt: answer}", new], "names the column(s)"),
        ([ckpt, ok, "--fields={text: question}", new], "--fields {'text': 'question'}: ['text'] is not a format"),
        ([ckpt, f"--prompts={tmp_path / 'missing.txt'}", new], "missing.txt' does not exist"),
        ([f"--ckpt_path={tmp_path / 'missing.ckpt'}", ok, new], "missing.ckpt' does not exist"),
        ([ckpt, ok, f"--out={tmp_path / 'done.jsonl'}"], "done.jsonl' exists: pass --overwrite"),
        ([ckpt, ok, f"--out={tmp_path / 'a_dir'}"], "a_dir' is a directory; name a .jsonl file"),
        ([ckpt, ok, f"--out={tmp_path / 'ok.txt'}", "--overwrite"], "is the prompts file this command reads"),
        ([f"--model={tmp_path / 'no_model'}", ok, new], "--model '" + str(tmp_path / "no_model") + "' does not exist"),
        ([f"--model={tmp_path / 'ok.txt'}", ok, new], "ok.txt' is a file"),
        ([f"--model={tmp_path / 'a_dir'}", ok, new], "a_dir' holds neither config.json (a merged model) nor"),
        (
            [f"--model={ggufs}", ok, new],
            f"nor adapter_config.json (a peft adapter). Its directory is a GGUF export: {the_file}",
        ),
        (
            [f"--model={ggufs / 'Modelfile'}", ok, new],
            f"training checkpoint instead. Its directory is a GGUF export: {the_file}",
        ),
        ([f"--model={tmp_path / 'a_dir'}", ok, new, "--device=gpu"], "--device 'gpu' is not a device: give auto,"),
        ([ckpt, ok, new, "--split=test"], f"--split 'test': --prompts ({tmp_path / 'ok.txt'}) has no splits"),
        ([ckpt, ok, new, "--top_p=0.9"], "top_p=0.9 sets sampling, and do_sample is off: greedy decoding would"),
        ([ckpt, ok, new, "--max-new-tokens=5"], "--max-new-tokens is not an option of pl-lowprec generate: did you"),
        ([f"--model={ggufs}", ok, new, "--max-new-tokens", "5"], "did you mean --max_new_tokens? Its options are"),
        ([f"--model={ggufs}", ok, new, "--data.seq_len=4"], "does not know --data.seq_len=4: config overrides"),
        ([f"--model={tmp_path / 'a_dir'}", ok, new, "--device=cuda:7"], "--device 'cuda:7': this machine has"),
    ]
    before = snapshot(tmp) | snapshot(tmp_path)
    for args, said in cases:
        line = refusal(capsys, ["generate", *args])
        assert line.startswith("pl-lowprec generate: error: ") and said in line, (args, line)
    assert snapshot(tmp) | snapshot(tmp_path) == before


def test_estimate_and_plan_refusals_are_one_paragraph(run, tmp_path, capsys, monkeypatch):
    tmp, _, checkpoint = run
    config = checkpoint.parents[1] / "config.yaml"  # the run's own, as fit saved it
    misspelled = tmp_path / "misspelled.yaml"
    misspelled.write_text(config.read_text().replace("pl_lowprec.models.CausalLM", "pl_lowprec.models.CausalLMM"))
    own = tmp_path / "own.yaml"
    own.write_text(config.read_text())
    cases = [
        (["estimate", f"--config={misspelled}"], "class_path 'pl_lowprec.models.CausalLMM' in"),
        (["estimate", f"--config={config}", "--trainer.devices=-2"], "trainer.devices='-2' is not a number of"),
        (["estimate", f"--config={config}", "--trainer.devices=0"], "trainer.devices='0' is not a number of"),
        (["plan", f"--config={misspelled}", "--memory=1GiB"], "pl_lowprec.models.CausalLMM"),
        (["plan", f"--config={config}", "--memory=1GiB", "--devices=0"], "--devices: 0 is too small"),
        (["plan", f"--config={config}", "--memory=1GiB", "--devices=-2"], "--devices: -2 is too small"),
        (["plan", f"--config={config}", "--memory=1GiB", "--trainer.devices=0"], "trainer.devices='0' is not"),
        (["plan", f"--config={config}", "--memory=lots"], "--memory='lots' is not a memory size"),
        (  # never over a config it reads, even with --overwrite, and with several configs
            ["plan", f"--config={config}", f"--config={own}", "--memory=1GiB", f"--out={own}", "--overwrite"],
            "is the config (2 of 2) this command reads",
        ),
        (["plan", f"--config={own}", "--memory=1GiB", f"--out={own}", "--overwrite"], "is the config this command"),
        (  # an own option mistyped is named, not handed to the config parser as an override
            ["plan", f"--config={config}", "--memory=1GiB", "--allow-quantization"],
            "--allow-quantization is not an option of pl-lowprec plan: did you mean --allow_quantization?",
        ),
        (["estimate", f"--config={config}", "--plto=x.png"], "--plto is not an option of pl-lowprec estimate: did"),
    ]
    before = snapshot(tmp) | snapshot(tmp_path)
    for args, said in cases:
        line = refusal(capsys, args)
        assert line.startswith(f"pl-lowprec {args[0]}: error: ") and said in line, (args, line)
    assert snapshot(tmp) | snapshot(tmp_path) == before

    class Missing:
        message = "No module named 'matplotlib'"

        def __bool__(self):
            return False

    monkeypatch.setattr(imports, "_MATPLOTLIB", Missing())
    imports.import_matplotlib_pyplot.cache_clear()
    try:
        line = refusal(capsys, ["estimate", f"--config={config}", f"--plot={tmp_path / 'step.png'}"])
    finally:
        imports.import_matplotlib_pyplot.cache_clear()
    assert "estimate --plot needs matplotlib" in line and 'pip install "pl_lowprec[plot]"' in line
    assert not (tmp_path / "step.png").exists()


def test_the_debug_switch_shows_the_original_error(tmp_path, monkeypatch):
    """PL_LOWPREC_DEBUG=1 (or JSONARGPARSE_DEBUG=true) shows a subcommand's original error and its traceback."""
    monkeypatch.setenv("PL_LOWPREC_DEBUG", "1")
    with pytest.raises(FileNotFoundError, match=r"missing.ckpt' does not exist"):
        main(["export", f"--ckpt_path={tmp_path / 'missing.ckpt'}", f"--out={tmp_path / 'out'}"])


def test_fit_refusals_of_the_machine_and_of_a_checkpoint_from_another_model(run, tmp_path, capsys):
    """fp8 on a CPU and an unknown compile mode are refused before the first step; a checkpoint of another model,
    resumed with --allow_changed_hparams, is one paragraph instead of torch's line per tensor."""
    _, _, checkpoint = run
    fast = [f"--config={QUICKSTART}", "--trainer.accelerator=cpu", "--trainer.logger=false"]
    fast += [f"--trainer.default_root_dir={tmp_path}", "--trainer.max_steps=3", "--trainer.enable_progress_bar=false"]
    strategy = "--trainer.strategy.init_args"
    line = refusal(capsys, ["fit", *fast, f"{strategy}.quantization=null", f"{strategy}.fp8=rowwise"])
    assert "fit stopped before its first step: fp8='rowwise' needs a CUDA GPU" in line, line
    line = refusal(capsys, ["fit", *fast, f"{strategy}.compile={{mode: fastest}}"])
    assert "compile={'mode': 'fastest'} is not a mode of torch.compile's inductor backend" in line, line
    assert "'max-autotune-no-cudagraphs'" in line
    before = snapshot(checkpoint.parents[2])
    line = refusal(capsys, ["fit", *fast, f"--ckpt_path={checkpoint}", "--allow_changed_hparams=true"])
    assert re.search(r"The checkpoint does not fit the model this config builds: \d+ tensors have other shapes", line)
    assert "in the checkpoint," in line and "resume with the config it was trained with" in line
    assert snapshot(checkpoint.parents[2]) == before
    assert not any(tmp_path.rglob("*.ckpt"))


def _shell(*args: str) -> subprocess.CompletedProcess:
    env = warm_python.with_pythonpath(ROOT)  # the CLI from a shell, a fresh interpreter: no warm child
    return subprocess.run(
        [sys.executable, "-m", "pl_lowprec", *args], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env
    )


def _error_lines(result: subprocess.CompletedProcess) -> list[str]:
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stdout + result.stderr
    return [line for line in result.stderr.splitlines() if "error: " in line]


def test_from_a_shell_an_export_refusal_is_one_line_and_no_traceback(run, tmp_path):
    _, _, checkpoint = run
    out = tmp_path / "data"
    out.mkdir()
    (out / "train.jsonl").write_text("{}\n")
    result = _shell("export", f"--ckpt_path={checkpoint}", f"--out={out}")
    errors = _error_lines(result)
    assert len(errors) == 1 and "--overwrite would not empty it either" in errors[0], result.stderr
    assert [line for line in result.stderr.splitlines() if line.strip()] == errors  # nothing else was printed
    assert snapshot(out) == {out / "train.jsonl": b"{}\n"}


def test_from_a_shell_a_generate_refusal_is_one_line_and_no_traceback(tmp_path):
    """(memory_budget=: its setup lines once, not once per candidate, is tests/memory/test_budget.py's.)"""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "ok"}\n{bad json\n')
    (tmp_path / "merged").mkdir()
    (tmp_path / "merged/config.json").write_text("{}")
    model = f"--model={tmp_path / 'merged'}"
    result = _shell("generate", model, f"--prompts={prompts}", f"--out={tmp_path / 'out.jsonl'}")
    assert _error_lines(result) == [
        f"pl-lowprec generate: error: {prompts}:2: not valid JSON (Expecting property name enclosed in double quotes)."
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["merged", "prompts.jsonl"]


def test_a_tokenizer_template_in_chat_template_jinja_is_found(run, tmp_path):
    """Current transformers saves a tokenizer's chat template as chat_template.jinja, not in tokenizer_config.json:
    generate --chat finds it there, from a checkpoint (with --tokenizer) as from a model directory."""
    _, pretrained, checkpoint = run
    assert (pretrained / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((pretrained / "tokenizer_config.json").read_text())
    prompts = tmp_path / "questions.txt"
    prompts.write_text("def add(a, b):\n")
    for source in ([f"--ckpt_path={checkpoint}", f"--tokenizer={pretrained}"], [f"--model={pretrained}"]):
        out = tmp_path / "answers.jsonl"
        main(["generate", *source, f"--prompts={prompts}", f"--out={out}", "--chat", "--max_new_tokens=2"])
        assert json.loads(out.read_text())["prompt"] == "def add(a, b):"
        out.unlink()


def test_a_checkpoint_state_mismatch_names_the_first_tensor():
    from pl_lowprec.adapters import mismatch_summary

    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    with pytest.raises(RuntimeError) as raised:
        model.load_state_dict({"0.weight": torch.ones(2, 4), "0.bias": torch.ones(2), "1.weight": torch.ones(1)})
    assert mismatch_summary(raised.value) == (
        "2 tensors have other shapes (e.g. 0.weight: [2, 4] in the checkpoint, [3, 4] in the model);"
        " 1 unexpected keys (e.g. 1.weight)"
    )
