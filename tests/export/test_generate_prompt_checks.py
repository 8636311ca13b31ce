"""``pl-lowprec generate`` checks its chat prompts as training checks its records (``ChatTemplate.check_turns``): a
role the template does not know, a turn it drops, and template arguments it never reads were rendered as they
came, and the model answered another conversation than the one given, without a word. Each is refused in one
paragraph (exit 2), before the model loads: the model directories here hold a config but no weights, and the
checkpoint no state, so a refusal that came after loading would be another error."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from loading_helpers import save_pretrained_dir, save_with_template

from pl_lowprec.cli import main

pytest.importorskip("transformers")

USER = {"role": "user", "content": "def add(a, b):"}
NAMED_ROLES = (  # as Zephyr's: writes the roles it names, drops any other (a tool's answer)
    "{% for m in messages %}{% if m.role == 'user' %}<|user|>\n{{ m.content }}</s>\n"
    "{% elif m.role == 'assistant' %}<|assistant|>\n{{ m.content }}</s>\n{% endif %}{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}<|no_think|>{% endif %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    return save_pretrained_dir(tmp_path_factory.mktemp("pretrained"), hidden_size=32, layers=1)


@pytest.fixture(scope="module")
def no_weights(pretrained, tmp_path_factory):
    """The tokenizer (a template that names its roles) and config of ``pretrained``, without its weights."""
    directory = tmp_path_factory.mktemp("no_weights")
    save_with_template(pretrained, NAMED_ROLES, directory)
    shutil.copy(pretrained / "config.json", directory / "config.json")
    return directory


def refusal(capsys, args):
    """``pl-lowprec generate args``'s one-paragraph refusal (exit 2, no traceback)."""
    with pytest.raises(SystemExit) as exited:
        main(["generate", *args])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    return err


def write(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


@pytest.mark.parametrize(
    ("turns", "said"),
    [
        (
            [USER, {"role": "bing", "content": "return a + b"}, USER],
            "--prompts record 2 (first turn 'def add(a, b):'): a record with turns of role 'bing', which the chat"
            " template does not name",
        ),
        (
            [USER, {"role": "tool", "content": "3"}],
            "--prompts record 2 (first turn 'def add(a, b):'): a record with a 'tool' turn whose text the chat"
            " template does not write",
        ),
        (
            [USER],
            "--prompts record 2 (first turn 'def add(a, b):'): a record whose chat_template_kwargs name 'brief',"
            " which the chat template never reads",
        ),
    ],
)
def test_a_prompt_training_would_refuse_is_refused_before_the_model_loads(no_weights, tmp_path, capsys, turns, said):
    own = {"chat_template_kwargs": {"brief": True}} if turns == [USER] else {}
    prompts = write(tmp_path / "p.jsonl", [{"messages": [USER]}, {"messages": turns, **own}])
    out = tmp_path / "out.jsonl"
    err = refusal(capsys, [f"--model={no_weights}", f"--prompts={prompts}", f"--out={out}"])
    assert said in err and "Fix the record, or pass --tokenizer DIR" in err
    assert not out.exists()


def test_generates_template_arguments_the_template_never_reads_are_refused(no_weights, tmp_path, capsys):
    prompts = write(tmp_path / "p.jsonl", [{"messages": [USER]}])
    args = [f"--model={no_weights}", f"--prompts={prompts}", f"--out={tmp_path / 'out.jsonl'}"]
    err = refusal(capsys, [*args, '--chat_template_kwargs={"enable_thinkng": false}'])
    assert (
        f"""--chat_template_kwargs '{{"enable_thinkng": false}}': the chat template of the tokenizer in"""
        f" '{no_weights}' never reads 'enable_thinkng' (did you mean 'enable_thinking'?)" in err
    ), err


def test_a_checkpoints_prompts_are_checked_before_its_weights_load(pretrained, no_weights, tmp_path, capsys):
    checkpoint = tmp_path / "empty.ckpt"
    torch.save({}, checkpoint)  # a torch.save archive with nothing in it: restoring it would fail otherwise
    prompts = write(tmp_path / "p.jsonl", [{"messages": [USER, {"role": "bing", "content": "x"}, USER]}])
    err = refusal(
        capsys,
        [
            f"--ckpt_path={checkpoint}",
            f"--prompts={prompts}",
            f"--out={tmp_path / 'out.jsonl'}",
            "--config=configs/finetune-causal-lm.yaml",
            f"--model.pretrained={pretrained}",
            f"--data.tokenizer={no_weights}",
            f"--data.train_files={prompts}",
            "--data.val_files=null",
            "--trainer.strategy.init_args.quantization=null",
            "--trainer.accelerator=cpu",
        ],
    )
    assert "--prompts record 1 (first turn 'def add(a, b):'): a record with turns of role 'bing'" in err
