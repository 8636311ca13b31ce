"""``pl-lowprec generate`` on chat prompts: the tokenizer's chat template with its generation prompt."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from loading_helpers import save_pretrained_dir

from pl_lowprec.cli import main

pytest.importorskip("transformers")

CHATS = [
    [{"role": "user", "content": "def add(a, b):"}, {"role": "assistant", "content": "return a + b"}],
    [{"role": "system", "content": "Answer in Python."}, {"role": "user", "content": "import os"}],
    [
        {"role": "user", "content": "class A:"},
        {"role": "assistant", "content": "pass"},
        {"role": "user", "content": "for i in range(10):"},
    ],
]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return save_pretrained_dir(tmp_path_factory.mktemp("chat_model"), hidden_size=32, layers=1)


def transformers_completions(directory, conversations, max_new_tokens=6):
    """Reference: plain transformers, one conversation at a time, ``apply_chat_template`` + greedy generate."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory).eval()
    completions = []
    for turns in conversations:
        text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        ids = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        tokenized = tokenizer.apply_chat_template(turns, add_generation_prompt=True, return_dict=True)["input_ids"]
        assert ids[0].tolist() == list(tokenized)  # the template renders the same tokens either way
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.eos_token_id,
            )
        completions.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    return completions


def test_messages_records_get_the_chat_template_and_equal_transformers(chat_model, tmp_path):
    prompts = tmp_path / "chat.jsonl"
    prompts.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CHATS))
    out = tmp_path / "out.jsonl"
    main(["generate", f"--model={chat_model}", f"--prompts={prompts}", f"--out={out}", "--max_new_tokens=6"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    turns = [CHATS[0][:1], CHATS[1], CHATS[2]]  # a trailing assistant turn is the reference, not the prompt
    assert [r["messages"] for r in rows] == turns
    assert [r.get("reference") for r in rows] == ["return a + b", None, None]
    expected = transformers_completions(chat_model, turns)
    assert [r["completion"] for r in rows] == expected  # batched with left padding, equal to one by one
    assert len(set(expected)) > 1


def test_chat_flag_wraps_plain_prompts_as_one_user_turn(chat_model, tmp_path):
    prompts = tmp_path / "questions.txt"
    questions = ["def add(a, b):", "while True:"]
    prompts.write_text("\n".join(questions) + "\n")
    out = tmp_path / "out.jsonl"
    main(["generate", f"--model={chat_model}", f"--prompts={prompts}", f"--out={out}", "--max_new_tokens=6", "--chat"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == questions
    turns = [[{"role": "user", "content": q}] for q in questions]
    assert [r["completion"] for r in rows] == transformers_completions(chat_model, turns)
    plain = tmp_path / "plain.jsonl"  # without --chat the same lines stay raw text: other completions
    main(["generate", f"--model={chat_model}", f"--prompts={prompts}", f"--out={plain}", "--max_new_tokens=6"])
    assert [json.loads(line)["completion"] for line in plain.read_text().splitlines()] != [
        r["completion"] for r in rows
    ]


def test_chat_without_a_template_is_refused_before_the_model_loads(chat_model, tmp_path, capsys):
    from transformers import AutoTokenizer

    no_template = tmp_path / "no_template"  # a config but no weights: loading the model would fail differently
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(no_template)
    shutil.copy(chat_model / "config.json", no_template / "config.json")
    assert AutoTokenizer.from_pretrained(no_template).chat_template is None
    txt = tmp_path / "p.txt"
    txt.write_text("def f():\n")
    chat = tmp_path / "c.jsonl"
    chat.write_text(json.dumps({"messages": CHATS[1]}) + "\n")
    for prompts, flags in ((txt, ["--chat"]), (chat, [])):
        out = tmp_path / f"out_{prompts.suffix[1:]}.jsonl"
        with pytest.raises(SystemExit) as exited:
            main(["generate", f"--model={no_template}", f"--prompts={prompts}", f"--out={out}", *flags])
        err = capsys.readouterr().err
        assert exited.value.code == 2 and err.count("\n") == 1, err
        assert f"tokenizer '{no_template}' has none (no chat_template.jinja beside it, no chat_template in its" in err
        assert "Pass --tokenizer DIR" in err
        assert not out.exists()


def test_bad_messages_records_are_named(tmp_path):
    from pl_lowprec.export.prompt_files import read_prompts

    bad = tmp_path / "p.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "ok"}]}\n{"messages": [{"role": "user"}]}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2: 'messages' .* must be a list of \{role, content\} turns"):
        read_prompts(bad)
    bad.write_text('{"messages": [{"role": "assistant", "content": "only an answer"}]}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:1: 'messages' holds no turn before its last assistant turn"):
        read_prompts(bad)


def test_conversational_prompt_records_are_chats_with_their_completion_as_reference(chat_model, tmp_path):
    records = [
        {"prompt": CHATS[0][:1], "completion": CHATS[0][1:]},  # TRL's conversational prompt/completion
        {"prompt": CHATS[2]},  # and its prompt-only form
    ]
    prompts = tmp_path / "val.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out.jsonl"
    main(["generate", f"--model={chat_model}", f"--prompts={prompts}", f"--out={out}", "--max_new_tokens=6"])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["messages"] for r in rows] == [CHATS[0][:1], CHATS[2]]
    assert [r.get("reference") for r in rows] == ["return a + b", None]
    assert [r["completion"] for r in rows] == transformers_completions(chat_model, [CHATS[0][:1], CHATS[2]])


def test_a_records_tools_and_template_arguments_reach_the_prompt(chat_model, tmp_path):
    from transformers import AutoTokenizer

    from pl_lowprec.export.generate import prompt_ids
    from pl_lowprec.export.prompt_files import read_prompts

    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    tokenizer.chat_template = (
        "{% if tools %}<|tools|>{{ tools[0].function.name }}</s>\n{% endif %}{% for m in messages %}<|{{ m.role }}|>\n"
        "{{ m.content }}</s>\n{% endfor %}<|assistant|>\n{% if brief is defined and brief %}<|brief|>{% endif %}"
    )
    tool = {"type": "function", "function": {"name": "get_time", "parameters": {}}}
    prompts = tmp_path / "p.jsonl"
    record = {"prompt": CHATS[0][:1], "tools": [tool], "chat_template_kwargs": {"brief": True}}
    prompts.write_text(json.dumps(record) + "\n")
    (read,) = read_prompts(prompts)
    text = "<|tools|>get_time</s>\n<|user|>\ndef add(a, b):</s>\n<|assistant|>\n<|brief|>"
    assert prompt_ids(tokenizer, read) == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_alpaca_records_are_chats_with_their_output_as_reference(tmp_path):
    from pl_lowprec.export.generate import reference
    from pl_lowprec.export.prompt_files import read_prompts

    prompts = tmp_path / "alpaca.jsonl"
    prompts.write_text(json.dumps({"instruction": "Add.", "input": "2 and 3", "output": "5"}) + "\n")
    (record,) = read_prompts(prompts)
    assert record["messages"][:-1] == [{"role": "user", "content": "Add.\n2 and 3"}] and reference(record) == "5"


def test_generates_template_arguments_apply_under_a_records_own(chat_model, tmp_path, capsys):
    from transformers import AutoTokenizer

    from pl_lowprec.export.generate import prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    tokenizer.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}<|{{ mode | default('none') }}|>"
    turns = [{"role": "user", "content": "x = 1"}]
    for record, expected in (
        ({"messages": turns}, "x = 1<|fast|>"),
        ({"messages": turns, "chat_template_kwargs": {"mode": "slow"}}, "x = 1<|slow|>"),
    ):
        assert (
            prompt_ids(tokenizer, record, {"mode": "fast"})
            == tokenizer(expected, add_special_tokens=False)["input_ids"]
        )
    prompts = tmp_path / "p.txt"
    prompts.write_text("x = 1\n")
    with pytest.raises(SystemExit) as exited:
        main(
            [
                "generate",
                f"--model={chat_model}",
                f"--prompts={prompts}",
                f"--out={tmp_path / 'o.jsonl'}",
                "--chat_template_kwargs=[1]",
            ]
        )
    assert exited.value.code == 2 and "'[1]' is not a mapping: give '{\"enable_thinking" in capsys.readouterr().err


def test_a_prompt_the_chat_template_refuses_is_named_not_a_traceback(chat_model, tmp_path, capsys):
    """Gemma's template refuses a system turn with raise_exception: generate stopped with jinja2's traceback; a
    record's tools of another form, with transformers' words. Each now names the prompt and the fix."""
    from transformers import AutoTokenizer

    strict = tmp_path / "strict_tokenizer"
    tokenizer = AutoTokenizer.from_pretrained(chat_model)
    tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}<|{{ m.role }}|>\n{{ m.content }}</s>\n{% endfor %}<|assistant|>\n"
    )
    tokenizer.save_pretrained(strict)
    prompts = tmp_path / "p.jsonl"
    system_first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "x = 1"}]
    prompts.write_text(json.dumps({"messages": CHATS[0][:1]}) + "\n" + json.dumps({"messages": system_first}) + "\n")
    base = ["generate", f"--model={chat_model}", f"--tokenizer={strict}", f"--out={tmp_path / 'o.jsonl'}"]
    with pytest.raises(SystemExit) as exited:
        main([*base, f"--prompts={prompts}"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1, err
    assert "--prompts record 2 (first turn 'Be brief.'): the chat template refuses ('System role not supported';" in err
    assert "merge the system turn's text into the first user turn). Fix the record, or pass --tokenizer DIR" in err
    tools = tmp_path / "tools.jsonl"
    tools.write_text(json.dumps({"messages": CHATS[0][:1], "tools": "not json"}) + "\n")
    with pytest.raises(SystemExit):
        main([*base, f"--prompts={tools}"])
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--prompts record 1: 'tools' is 'not json' (a str), which is not valid JSON" in err
