"""Chat records as TRL publishes them: the conversational prompt/completion, templates that rewrite earlier turns
(refused, or read by their ``{% generation %}`` marks), and a record's ``tools`` and ``chat_template_kwargs``."""

import json

import pytest
from loading_helpers import save_tokenizer, save_with_template
from records_helpers import data_of_records, rows_as_lists

from pl_lowprec.data import TextDataModule
from pl_lowprec.data.chat import ChatTemplate

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "hello"},
    {"role": "assistant", "content": "<think>greet</think>hi"},
    {"role": "user", "content": "name?"},
    {"role": "assistant", "content": "<think>say it</think>pl"},
]
# As Qwen3's template does: an assistant turn before the last one loses its reasoning.
DROPS_REASONING = (
    "{% for m in messages %}<|{{ m.role }}|>\n"
    "{% if m.role == 'assistant' and not loop.last %}{{ m.content.split('</think>')[-1] }}"
    "{% else %}{{ m.content }}{% endif %}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# The same, with the assistant's text marked for Hugging Face's return_assistant_tokens_mask.
MARKED = (
    "{% for m in messages %}<|{{ m.role }}|>\n"
    "{% if m.role == 'assistant' %}{% generation %}"
    "{{ m.content.split('</think>')[-1] if not loop.last else m.content }}</s>{% endgeneration %}"
    "{% else %}{{ m.content }}</s>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
# Renders the tools' names, a tool call, and a template argument (as Qwen3's honours enable_thinking).
WITH_TOOLS = (
    "{% if tools %}<|tools|>{% for t in tools %}{{ t.function.name }};{% endfor %}</s>\n{% endif %}"
    "{% if persona is defined %}<|persona|>{{ persona }}</s>\n{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>\n"
    "{% if m.tool_calls %}call {{ m.tool_calls[0].function.name }}{% else %}{{ m.content }}{% endif %}</s>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
TOOL = {"type": "function", "function": {"name": "get_time", "description": "now", "parameters": {}}}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return save_tokenizer(tmp_path_factory.mktemp("tok"))


def _targets(data, sample):
    return data.tokenizer.decode([t for t in sample["labels"].tolist() if t != -100])


def test_conversational_prompt_completion_takes_loss_on_the_completion(tmp_path, tokenizer_dir):
    record = {"prompt": TURNS[:4], "completion": TURNS[4:]}
    data = data_of_records(tmp_path / "pc.jsonl", [record], str(tokenizer_dir))
    (sample,) = data.train_set
    assert _targets(data, sample) == "<think>say it</think>pl</s>"  # the first answer is context, not a target
    assert data.tokenizer.decode(sample["input_ids"]) == data.tokenizer.apply_chat_template(TURNS, tokenize=False)
    single = data_of_records(tmp_path / "m.jsonl", [{"messages": TURNS[1:3]}], str(tokenizer_dir))
    as_pc = data_of_records(
        tmp_path / "p.jsonl", [{"prompt": TURNS[1:2], "completion": TURNS[2:3]}], str(tokenizer_dir)
    )
    for key in ("input_ids", "labels"):  # one answer: the same sample as the messages record
        assert single.train_set[0][key].tolist() == as_pc.train_set[0][key].tolist()


def test_a_template_that_rewrites_earlier_turns_is_refused_naming_the_record(tmp_path, tokenizer_dir):
    tokenizer = save_with_template(tokenizer_dir, DROPS_REASONING, tmp_path / "qwen3_like")
    records = [{"messages": TURNS[1:3]}, {"messages": TURNS}]  # one answer renders the same; two do not
    with pytest.raises(ValueError) as refused:
        data_of_records(tmp_path / "chat.jsonl", records, tokenizer)
    message = str(refused.value)
    assert message.startswith(f"{tmp_path / 'chat.jsonl'}, line 2: the tokenizer's chat template renders the first")
    assert "<|assistant|>\\n<think>greet</think>hi</s>\\n' on their own and as '" in message
    assert "<|assistant|>\\nhi</s>\\n<|user|>\\nname?" in message  # where they differ, both ways
    assert "the loss would fall on the wrong tokens" in message
    assert '{"prompt": [the turns before it], "completion": [the turn]}' in message
    # The fix the message gives: each answer its own record, the earlier one as context, as the template renders it.
    split = [{"prompt": TURNS[:2], "completion": TURNS[2:3]}, {"prompt": TURNS[:4], "completion": TURNS[4:]}]
    data = data_of_records(tmp_path / "split.jsonl", split, tokenizer)
    assert [_targets(data, s) for s in data.train_set] == [
        "<think>greet</think>hi</s>",
        "<think>say it</think>pl</s>",
    ]
    assert "<|assistant|>\nhi</s>\n<|user|>\nname?" in data.tokenizer.decode(data.train_set[1]["input_ids"])


def test_generation_marks_choose_the_assistant_tokens(tmp_path, tokenizer_dir):
    tokenizer = save_with_template(tokenizer_dir, MARKED, tmp_path / "marked")
    data = data_of_records(tmp_path / "chat.jsonl", [{"messages": TURNS}], tokenizer)
    (sample,) = data.train_set
    assert _targets(data, sample) == "hi</s><think>say it</think>pl</s>"  # marked; the rewritten first answer
    expected = data.tokenizer.apply_chat_template(TURNS, return_dict=True, return_assistant_tokens_mask=True)
    assert sample["input_ids"].tolist() == list(expected["input_ids"])
    assert [label != -100 for label in sample["labels"].tolist()] == [bool(m) for m in expected["assistant_masks"]]


def test_tools_and_template_arguments_reach_the_template(tmp_path, tokenizer_dir):
    tokenizer = save_with_template(tokenizer_dir, WITH_TOOLS, tmp_path / "tools")
    call = {
        "role": "assistant",
        "tool_calls": [{"type": "function", "function": {"name": "get_time", "arguments": {}}}],
    }
    dialog = [{"role": "user", "content": "time?"}, call, {"role": "tool", "content": "noon"}]
    records = [
        {"dialog": [*dialog, {"role": "assistant", "content": "noon"}], "tools": [TOOL]},
        {"dialog": [*dialog[:1], {"role": "assistant", "content": "ok"}], "tools": json.dumps([TOOL])},
    ]
    data = data_of_records(tmp_path / "tools.jsonl", records, tokenizer, fields={"messages": "dialog"})
    first, second = (data.tokenizer.decode(s["input_ids"]) for s in data.train_set)
    assert first.startswith("<|tools|>get_time;</s>\n<|user|>\ntime?") and second.startswith("<|tools|>get_time;")
    assert _targets(data, data.train_set[0]) == "call get_time</s>noon</s>"  # the tool's answer is no target
    pc = {"prompt": dialog[:1], "completion": [{"role": "assistant", "content": "ok"}]}
    data = data_of_records(tmp_path / "kwargs.jsonl", [pc | {"chat_template_kwargs": {"persona": "terse"}}], tokenizer)
    (sample,) = data.train_set
    assert data.tokenizer.decode(sample["input_ids"]).startswith("<|persona|>terse</s>\n<|user|>\ntime?")
    assert _targets(data, sample) == "ok</s>"


def test_bare_tool_schemas_render_as_the_wrapped_ones(tmp_path, tokenizer_dir):
    """LLaMA-Factory's tools are bare schemas ({name, description, parameters}); Hugging Face's templates, and
    transformers' get_json_schema, use {"type": "function", "function": schema}. Passed bare, a template that writes
    each tool as JSON (as Qwen2.5's and Llama-3.1's do) trained on another tools text than the model meets at
    inference; they are wrapped, as LLaMA-Factory's own Llama-3/Qwen/Mistral formatters wrap them."""
    as_json = WITH_TOOLS.replace("{{ t.function.name }};", "{{ t | tojson }};")
    tokenizer = save_with_template(tokenizer_dir, as_json, tmp_path / "tojson")
    turns = [{"role": "user", "content": "time?"}, {"role": "assistant", "content": "noon"}]
    wrapped = data_of_records(tmp_path / "wrapped.jsonl", [{"messages": turns, "tools": [TOOL]}], tokenizer)
    text = wrapped.tokenizer.decode(wrapped.train_set[0]["input_ids"])
    assert text.startswith('<|tools|>{"type": "function", "function": {"name": "get_time"')
    for bare in ([TOOL["function"]], json.dumps([TOOL["function"]])):  # a list, or LLaMA-Factory's JSON string
        data = data_of_records(tmp_path / "bare.jsonl", [{"messages": turns, "tools": bare}], tokenizer)
        assert rows_as_lists(data.train_set) == rows_as_lists(wrapped.train_set)
        rendered = ChatTemplate.for_record(data.tokenizer, {"tools": bare}).render(turns[:1], generation_prompt=True)
        assert rendered == ChatTemplate.for_record(data.tokenizer, {"tools": [TOOL]}).render(turns[:1], True)


def test_alpaca_records_are_read_as_llama_factory_reads_them(tmp_path, tokenizer_dir):
    alpaca = [
        {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5", "text": "a pre-rendered copy"},
        {"instruction": "Greet.", "input": "", "output": "hi", "system": "Be brief.", "history": [["name?", "pl"]]},
    ]
    as_chats = [
        {"messages": [{"role": "user", "content": "Add the numbers.\n2 and 3"}, {"role": "assistant", "content": "5"}]},
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "name?"},
                {"role": "assistant", "content": "pl"},
                {"role": "user", "content": "Greet."},
                {"role": "assistant", "content": "hi"},
            ]
        },
    ]
    data = data_of_records(tmp_path / "alpaca.jsonl", alpaca, str(tokenizer_dir))
    chats = data_of_records(tmp_path / "chats.jsonl", as_chats, str(tokenizer_dir))
    assert rows_as_lists(data.train_set) == rows_as_lists(chats.train_set)
    assert [_targets(data, s) for s in data.train_set] == ["5</s>", "pl</s>hi</s>"]  # not the text column


def test_the_data_modules_template_arguments_apply_to_every_record_under_its_own(tmp_path, tokenizer_dir):
    tokenizer = save_with_template(tokenizer_dir, WITH_TOOLS, tmp_path / "tools")
    turns = [{"role": "user", "content": "time?"}, {"role": "assistant", "content": "noon"}]
    records = [{"messages": turns}, {"messages": turns, "chat_template_kwargs": {"persona": "chatty"}}]
    data = data_of_records(tmp_path / "chat.jsonl", records, tokenizer, chat_template_kwargs={"persona": "terse"})
    rendered = [data.tokenizer.decode(s["input_ids"]) for s in data.train_set]
    assert rendered[0].startswith("<|persona|>terse</s>") and rendered[1].startswith("<|persona|>chatty</s>")
    with pytest.raises(ValueError, match=r"chat_template_kwargs='enable_thinking'\) must map the chat template's"):
        TextDataModule(train_files=tmp_path / "chat.jsonl", tokenizer=tokenizer, chat_template_kwargs="enable_thinking")


def test_a_tokenizer_with_named_templates_renders_with_the_one_a_record_takes(tmp_path, tokenizer_dir):
    """transformers keeps several templates by name (``default``, ``tool_use``) and takes ``tool_use`` where the
    record has tools: its generation marks are read from that one."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    writes_tools = "{% if tools %}<|tools|>{% for t in tools %}{{ t.function.name }};{% endfor %}</s>\n{% endif %}"
    tokenizer.chat_template = {"default": tokenizer.chat_template, "tool_use": writes_tools + MARKED}
    tokenizer.save_pretrained(tmp_path / "named")
    records = [{"messages": TURNS[1:3]}, {"messages": TURNS, "tools": [TOOL]}]
    data = data_of_records(tmp_path / "chat.jsonl", records, str(tmp_path / "named"))
    assert [_targets(data, s) for s in data.train_set] == [
        "<think>greet</think>hi</s>",  # the default template: prefixes
        "hi</s><think>say it</think>pl</s>",  # tool_use: its marks (the prefixes would be refused: it rewrites)
    ]


def test_a_turn_the_template_ends_without_an_end_token_is_refused_or_given_the_eos(tmp_path, tokenizer_dir):
    """A template that ends turns with a newline alone trained ``hi\n``: no token to stop on, so the fine-tuned
    model never stopped in generate. Refused before any step by default, naming the fix; ``eos_after_turns=True``
    writes the EOS after the turn's text, as a template ending it with ``{{ eos_token }}`` would;
    ``eos_after_turns=False`` keeps the turn as the template writes it, the newline its only end."""
    plain = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    plain += "{% if add_generation_prompt %}assistant: {% endif %}"
    tokenizer = save_with_template(tokenizer_dir, plain, tmp_path / "plain")
    ended = "{% if m.role == 'assistant' %}</s>{% endif %}{{ '\\n' }}"  # jinja eats the newline after a block tag
    ended = plain.replace("{{ m.content }}\n", "{{ m.content }}" + ended)
    ended = save_with_template(tokenizer_dir, ended, tmp_path / "ended")
    records = [{"messages": TURNS[1:]}, {"prompt": TURNS[1:2], "completion": TURNS[2:3]}]
    with pytest.raises(ValueError) as error:
        data_of_records(tmp_path / "chat.jsonl", records, tokenizer)
    said = str(error.value)
    assert said.startswith(f"{tmp_path / 'chat.jsonl'}, line 1: the chat template ends an assistant turn with no")
    assert "(its text ends '<think>greet</think>hi\\n')" in said and "generate would not stop" in said
    assert "--data.eos_after_turns true to write the tokenizer's EOS '</s>' after each assistant turn" in said
    given = data_of_records(tmp_path / "eos.jsonl", records, tokenizer, eos_after_turns=True)
    expected = data_of_records(tmp_path / "ended.jsonl", records, ended)
    assert rows_as_lists(given.train_set) == rows_as_lists(expected.train_set)
    both, first = "<think>greet</think>hi</s><think>say it</think>pl</s>", "<think>greet</think>hi</s>"
    assert [_targets(given, s) for s in given.train_set] == [both, first]
    kept = data_of_records(tmp_path / "kept.jsonl", records[:1], tokenizer, eos_after_turns=False)
    assert _targets(kept, kept.train_set[0]) == "<think>greet</think>hi\n<think>say it</think>pl\n"


def test_every_assistant_turn_of_a_completion_is_checked_for_its_end_token(tmp_path, tokenizer_dir):
    """A completion of several turns (a tool call, its result, the answer) was one span whose end alone was
    checked: a template that ends a tool call with a newline trained ``call get_time\n`` with no token to stop on,
    so the model never stopped after a call. Each assistant turn of it is now refused, given the EOS, or kept."""
    unended = (
        "{% for m in messages %}<|{{ m.role }}|>\n{% if m.tool_calls %}call {{ m.tool_calls[0].function.name }}"
        "{{ '\\n' }}{% else %}{{ m.content }}</s>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    tokenizer = save_with_template(tokenizer_dir, unended, tmp_path / "unended")
    ended = save_with_template(tokenizer_dir, unended.replace("{{ '\\n' }}", "</s>\n"), tmp_path / "ended")
    call = {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "get_time"}}]}
    completion = [call, {"role": "tool", "content": "noon"}, {"role": "assistant", "content": "It is noon."}]
    records = [{"prompt": [{"role": "user", "content": "Time?"}], "completion": completion}]
    with pytest.raises(ValueError) as error:
        data_of_records(tmp_path / "chat.jsonl", records, tokenizer)
    said = str(error.value)
    assert said.startswith(f"{tmp_path / 'chat.jsonl'}, line 1: the chat template ends an assistant turn with no")
    assert "(its text ends 'call get_time\\n')" in said
    given = data_of_records(tmp_path / "eos.jsonl", records, tokenizer, eos_after_turns=True)
    expected = data_of_records(tmp_path / "ended.jsonl", records, ended)
    assert rows_as_lists(given.train_set) == rows_as_lists(expected.train_set)
    trained = "call get_time</s><|tool|>\nnoon</s>\n<|assistant|>\nIt is noon.</s>"
    assert _targets(given, given.train_set[0]) == trained  # the tool's result a target, as TRL trains a completion
    kept = data_of_records(tmp_path / "kept.jsonl", records, tokenizer, eos_after_turns=False)
    assert _targets(kept, kept.train_set[0]) == "call get_time\n<|tool|>\nnoon</s>\n<|assistant|>\nIt is noon.</s>"
    # a template that rewrites an assistant turn once others follow (as Qwen3's): the turn's end is not read from
    # its prefix, the completion trains whole, as before (it is no reason to refuse the record)
    rewrites = save_with_template(tokenizer_dir, DROPS_REASONING, tmp_path / "rewrites")
    completion = [TURNS[2], {"role": "tool", "content": "noon"}, TURNS[4]]
    whole = data_of_records(tmp_path / "r.jsonl", [{"prompt": TURNS[1:2], "completion": completion}], rewrites)
    trained = "hi</s>\n<|tool|>\nnoon</s>\n<|assistant|>\n<think>say it</think>pl</s>"
    assert _targets(whole, whole.train_set[0]) == trained


def test_generation_marks_without_an_end_token_are_refused_or_given_the_eos(tmp_path, tokenizer_dir):
    """The same for a template whose {% generation %} marks hold no end token (TRL's assistant_only_loss reads
    such marks and trains no token to stop on)."""
    marked = (
        "{% for m in messages %}{{ m.role }}: {% if m.role == 'assistant' %}{% generation %}{{ m.content }}"
        "{% endgeneration %}{% else %}{{ m.content }}{% endif %}{{ '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    tokenizer = save_with_template(tokenizer_dir, marked, tmp_path / "marked")
    records = [{"messages": TURNS[1:3]}]
    with pytest.raises(ValueError, match=r"line 1: the chat template ends an assistant turn with no end-of-turn"):
        data_of_records(tmp_path / "chat.jsonl", records, tokenizer)
    given = data_of_records(tmp_path / "eos.jsonl", records, tokenizer, eos_after_turns=True)
    assert _targets(given, given.train_set[0]) == "<think>greet</think>hi</s>"
    assert (
        given.tokenizer.decode(given.train_set[0]["input_ids"])
        == "user: hello\nassistant: <think>greet</think>hi</s>\n"
    )


# A template that writes a default system turn where the conversation has none (as ChatML-style ones do), without
# and with generation marks.
DEFAULT_SYSTEM = "{% if messages[0].role != 'system' %}<|system|>\nYou are helpful.</s>\n{% endif %}"
DEFAULT_SYSTEM_PLAIN = (
    DEFAULT_SYSTEM + "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
DEFAULT_SYSTEM_MARKED = (
    DEFAULT_SYSTEM + "{% for m in messages %}<|{{ m.role }}|>\n"
    "{% if m.role == 'assistant' %}{% generation %}{{ m.content }}</s>{% endgeneration %}"
    "{% else %}{{ m.content }}</s>{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def test_a_conversation_that_starts_with_an_assistant_turn_trains_on_its_text_only(tmp_path, tokenizer_dir):
    """Greeting-first chats: the default system turn and the role's header before the first answer are context,
    as the template's generation marks have them (they were all targets)."""
    greeting = [
        {"role": "assistant", "content": "Welcome"},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi"},
    ]
    samples = {}
    for name, template in (("plain", DEFAULT_SYSTEM_PLAIN), ("marked", DEFAULT_SYSTEM_MARKED)):
        tokenizer = save_with_template(tokenizer_dir, template, tmp_path / name)
        data = data_of_records(tmp_path / f"{name}.jsonl", [{"messages": greeting}], tokenizer)
        (samples[name],) = data.train_set
    assert _targets(data, samples["plain"]) == "Welcome</s>hi</s>"
    for key in ("input_ids", "labels"):
        assert samples["plain"][key].tolist() == samples["marked"][key].tolist()
    # A template that does not write the text as given (here upper-cased): where it starts is not known.
    upper = save_with_template(
        tokenizer_dir,
        "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content | upper }}</s>\n{% endfor %}",
        tmp_path / "upper",
    )
    with pytest.raises(ValueError, match=r"1 record starting with an assistant turn whose text the chat template"):
        data_of_records(tmp_path / "upper.jsonl", [{"messages": greeting}], upper)


def test_the_answers_first_token_is_trained_after_a_generation_prompt_ending_in_a_space(tmp_path, tokenizer_dir):
    """'Assistant: ' + 'return x': the token ' return' starts at the prompt's space and carries the answer's first
    characters; it was left out of the targets."""
    spaced = (
        "{% for m in messages %}{% if m.role == 'user' %}{{ 'User: ' + m.content + '\\n' }}"
        "{% else %}{{ 'Assistant: ' + m.content + eos_token + '\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ 'Assistant: ' }}{% endif %}"
    )
    tokenizer = save_with_template(tokenizer_dir, spaced, tmp_path / "spaced")
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "return x"}]
    records = [{"messages": turns}, {"prompt": turns[:1], "completion": turns[1:]}]
    data = data_of_records(tmp_path / "chat.jsonl", records, tokenizer)
    assert [_targets(data, s) for s in data.train_set] == [" return x</s>", " return x</s>"]


# As Gemma's template does: no system role.
NO_SYSTEM = (
    "{% if messages[0].role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    "{% for m in messages %}<|{{ m.role }}|>\n{{ m.content }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def test_a_record_the_template_refuses_is_counted_with_its_line_and_the_fix(tmp_path, tokenizer_dir):
    """It stopped the run with jinja2's traceback, naming no file or line."""
    tokenizer = save_with_template(tokenizer_dir, NO_SYSTEM, tmp_path / "gemma_like")
    records = [{"messages": TURNS[1:3]}, {"messages": TURNS[:3]}]
    data = data_of_records(tmp_path / "chat.jsonl", records, tokenizer, max_skipped_fraction=1)
    (report,) = data.reports
    assert report.used == 1 and report.first_lines == {
        "records the chat template refuses ('System role not supported'; the template has no system role: merge"
        " the system turn's text into the first user turn)": [2]
    }


@pytest.mark.parametrize(
    ("field", "value", "said"),
    [
        (
            "tools",
            "not json",
            "'tools' is 'not json' (a str), which is not valid JSON (Expecting value at character 0)",
        ),
        ("tools", '["f"]', "'tools' is '[\"f\"]' (a str), not a list of JSON schemas"),  # one schema alone is read
        ("chat_template_kwargs", "enable_thinking=false", "'chat_template_kwargs' is 'enable_thinking=false' (a str)"),
    ],
)
def test_tools_or_template_arguments_of_another_form_are_refused_naming_the_line(
    field, value, said, tmp_path, tokenizer_dir
):
    """They stopped the run with a traceback (AttributeError), or a JSON error that read like the file's own
    line 1 was broken, or transformers' words without the file or line."""
    tokenizer = save_with_template(tokenizer_dir, WITH_TOOLS, tmp_path / "tools")
    records = [{"messages": TURNS[1:3]}, {"messages": TURNS[1:3], field: value}]
    with pytest.raises(ValueError) as refused:
        data_of_records(tmp_path / "chat.jsonl", records, tokenizer)
    message = str(refused.value)
    assert message.startswith(f"{tmp_path / 'chat.jsonl'}, line 2: {said}")
    allowed = "a list of JSON schemas" if field == "tools" else 'as a JSON object ({"enable_thinking": false})'
    assert allowed in message and "Fix: " in message


def test_template_arguments_stored_as_json_text_are_read(tmp_path, tokenizer_dir):
    """A CSV cell holds text: the arguments as a JSON string of an object, as tools may be."""
    tokenizer = save_with_template(tokenizer_dir, WITH_TOOLS, tmp_path / "tools")
    record = {"messages": TURNS[1:3], "chat_template_kwargs": json.dumps({"persona": "terse"})}
    data = data_of_records(tmp_path / "chat.jsonl", [record], tokenizer)
    assert data.tokenizer.decode(data.train_set[0]["input_ids"]).startswith("<|persona|>terse</s>")


def test_an_empty_answer_is_refused_as_an_empty_completion_is(tmp_path, tokenizer_dir):
    """An empty assistant turn (a blank alpaca ``output`` too) left only its end-of-turn token as a target: the
    model learnt to end its answer at once, where an empty string completion was refused. A tool-call-only answer
    is not empty."""
    call = {"type": "function", "function": {"name": "get_time", "arguments": {}}}
    records = [
        {"messages": TURNS[1:3]},  # 1: used
        {"messages": [TURNS[1], {"role": "assistant", "content": "  "}]},  # 2
        {"messages": [*TURNS[1:3], TURNS[3], {"role": "assistant", "content": ""}]},  # 3: the second answer empty
        {"instruction": "Greet.", "input": "", "output": ""},  # 4: alpaca
        {"prompt": [TURNS[1]], "completion": [{"role": "assistant", "content": "\n"}]},  # 5
        {"messages": [TURNS[1], {"role": "assistant", "content": "", "tool_calls": [call]}]},  # 6: used
        {"messages": [TURNS[1], {"role": "assistant", "content": "</s>"}]},  # 7: the EOS alone
    ]
    template = save_with_template(tokenizer_dir, WITH_TOOLS, tmp_path / "t")
    data = data_of_records(tmp_path / "chat.jsonl", records, template, max_skipped_fraction=1)
    (report,) = data.reports
    assert report.used == 2
    reason = (
        "records with an empty assistant turn (it would train the model to end its answer at once): drop them or"
        " write their answers"
    )
    assert report.first_lines == {reason: [2, 3, 4, 5, 7]}
    assert [_targets(data, s) for s in data.train_set] == ["<think>greet</think>hi</s>", "call get_time</s>"]


def test_content_as_a_list_of_parts_is_refused_with_the_fix(tmp_path, tokenizer_dir):
    """OpenAI's and the vision models' turns hold ``content`` as typed parts; a text template would write the
    list's Python text. The reason said only "not a list of {role, content} turns", which they seem to be."""
    parts = [{"type": "text", "text": "hello"}]
    records = [{"messages": TURNS[1:3]}, {"messages": [{"role": "user", "content": parts}, TURNS[2]]}]
    data = data_of_records(tmp_path / "chat.jsonl", records, str(tokenizer_dir), max_skipped_fraction=1)
    (reason,) = data.reports[0].bad
    assert reason.startswith("records whose 'messages' is not a list of {role, content} turns (a turn whose")
    assert "'content' is a list of parts" in reason and "join the parts' text into one string" in reason


def test_an_answer_ending_with_the_eos_the_template_writes_trains_it_once(tmp_path, tokenizer_dir):
    """``"hi</s>"`` under a template that writes ``</s>`` after each turn was trained ``hi</s></s>`` (EOS -> EOS),
    where a string completion's own EOS is kept once. Under a template that writes no end token the answer's EOS
    is its only one, and stays."""
    user, answer = TURNS[1], {"role": "assistant", "content": "hi"}
    ending = {**answer, "content": "hi</s>"}
    plain = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    plain = save_with_template(tokenizer_dir, plain + "{% if add_generation_prompt %}assistant: {% endif %}", tmp_path)
    as_given = [{"messages": [user, answer]}, {"prompt": [user], "completion": [answer]}]
    ending_eos = [{"messages": [user, ending]}, {"prompt": [user], "completion": [ending]}]
    expected = data_of_records(tmp_path / "given.jsonl", as_given, str(tokenizer_dir))
    data = data_of_records(tmp_path / "ending.jsonl", ending_eos, str(tokenizer_dir))
    assert rows_as_lists(data.train_set) == rows_as_lists(expected.train_set)
    assert [_targets(data, s) for s in data.train_set] == ["hi</s>", "hi</s>"]
    assert (
        "2 records whose assistant turn ends with the EOS '</s>' that the chat template"
        in data.reports[0].describe_notes()
    )
    kept = data_of_records(tmp_path / "plain.jsonl", ending_eos[:1], plain)
    assert _targets(kept, kept.train_set[0]) == "hi</s>"  # its one EOS, kept


def test_template_arguments_or_tools_the_template_never_reads_are_refused(tmp_path, tokenizer_dir):
    """apply_chat_template passes arguments a template does not use, and tools a template has no section for,
    without a word: ``enable_thinking`` under a template without the switch (or misspelt) changed nothing, and
    tool calls trained without the definitions."""
    tokenizer = save_with_template(tokenizer_dir, WITH_TOOLS, tmp_path / "tools")
    turns = [{"role": "user", "content": "time?"}, {"role": "assistant", "content": "noon"}]
    with pytest.raises(ValueError) as error:
        data_of_records(tmp_path / "chat.jsonl", [{"messages": turns}], tokenizer, chat_template_kwargs={"persna": 1})
    said = str(error.value)
    assert said.startswith("TextDataModule(chat_template_kwargs={'persna': 1}): the chat template of the tokenizer")
    assert "never reads 'persna' (did you mean 'persona'?)" in said and "Fix: name an argument the template" in said
    records = [{"messages": turns}] * 3 + [{"messages": turns, "chat_template_kwargs": {"enable_thinking": False}}]
    data = data_of_records(tmp_path / "own.jsonl", records, tokenizer, max_skipped_fraction=1)
    assert "1 record whose chat_template_kwargs name 'enable_thinking', which the chat template never reads" in (
        data.reports[0].describe()
    )
    no_tools = save_with_template(tokenizer_dir, DEFAULT_SYSTEM_PLAIN, tmp_path / "no_tools")
    records = [{"messages": turns}, {"messages": turns, "tools": [TOOL]}]
    data = data_of_records(tmp_path / "tools.jsonl", records, no_tools, max_skipped_fraction=1)
    assert data.reports[0].used == 1
    assert "1 record with tools ('get_time') the chat template does not write" in data.reports[0].describe()


def test_a_records_whole_conversation_is_rendered_once(tokenizer_dir):
    """The check that every turn is written rendered the conversation, the encoding rendered it again, and the
    last turn's end rendered it a third time: three template runs of the whole record where one gives the text."""
    from transformers import AutoTokenizer

    from pl_lowprec.data.chat import ChatTemplate

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    rendered, apply = [], tokenizer.apply_chat_template
    tokenizer.apply_chat_template = lambda turns, **options: rendered.append(len(turns)) or apply(turns, **options)
    template = ChatTemplate(tokenizer)
    messages = template.encode_messages(TURNS)
    assert rendered.count(len(TURNS)) == 1, rendered
    rendered.clear()
    completion = template.encode_completion(TURNS[:4], TURNS[4:])
    assert rendered.count(len(TURNS)) == 1, rendered
    whole = apply(TURNS, tokenize=False)
    assert tokenizer.decode(messages.input_ids) == tokenizer.decode(completion.input_ids) == whole
