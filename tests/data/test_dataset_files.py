"""TextDataModule through Hugging Face datasets: every format gives the batches (and first loss) of the same records
as .jsonl; field mappings and ShareGPT chats equal the renamed records; the checks of .jsonl hold; the tokens stay
in a memory-mapped Arrow table."""

import json
import logging
import re
import shutil

import pytest
import torch
from loading_helpers import save_pretrained_dir, save_with_template
from records_helpers import rows_as_lists

from pl_lowprec.data import TextDataModule, token_table
from pl_lowprec.data.text_blocks import TextBlocks
from pl_lowprec.data.token_table import TableDocuments, TokenRows

datasets = pytest.importorskip("datasets")
pytest.importorskip("transformers")

RECORDS = [
    *({"prompt": f"def f{i}(x):\n    return", "completion": f" x + {i}" * (1 + i % 3)} for i in range(14)),
    *({"text": f"import os\nprint(os.sep * {i})\n" * (2 + i % 4)} for i in range(6)),
    {"prompt": "only a prompt"},  # unusable: counted with its row
    {"note": "no field this module reads"},
    *({"prompt": f"x{i} =", "completion": f" {i}"} for i in range(6)),
    {"prompt": "What is 6 x 7? ", "completion": "42"},  # CSV: a number stays text
    {"prompt": "Which value is missing? ", "completion": "None"},  # CSV: only an empty cell is missing
]
CHATS = [
    {
        "messages": [
            *([{"role": "system", "content": "Be brief."}] if i % 2 else []),
            {"role": "user", "content": f"What is {i} + {i}?"},
            {"role": "assistant", "content": f"{2 * i}."},
            {"role": "user", "content": "And doubled?"},
            {"role": "assistant", "content": f"{4 * i}."},
        ]
    }
    for i in range(10)
]
TOOL = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
CALL = {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "add", "arguments": {"x": 1}}}]}
CONVERSATIONAL = [  # TRL's conversational prompt/completion; a table gives every turn every key, None where absent
    *({"prompt": c["messages"][:-1], "completion": c["messages"][-1:]} for c in CHATS),
    {
        "prompt": [{"role": "user", "content": "1 + 1?"}],
        "completion": [CALL, {"role": "tool", "content": "2"}, {"role": "assistant", "content": "2."}],
        "tools": [TOOL],
    },
]
ALPACA = [  # a table gives every record input, system and history, None where absent
    {"instruction": f"Double {i}.", "output": f"{2 * i}", **({"input": "in words"} if i % 2 else {})} for i in range(6)
] + [{"instruction": "Greet.", "output": "hi", "system": "Be brief.", "history": [["name?", "pl"]]}]
FORMATS = ["parquet", "csv", "json", "json-array", "arrow", "arrow-ipc-file", "saved", "Dataset", "DatasetDict"]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    return save_pretrained_dir(tmp_path_factory.mktemp("pretrained"))


pytestmark = pytest.mark.usefixtures("datasets_cache_in_tmp")


def _table(records):
    """A Dataset with a column for every field any record has (None where a record lacks it), as Arrow holds them."""
    keys = list(dict.fromkeys(k for r in records for k in r))
    return datasets.Dataset.from_dict({k: [r.get(k) for r in records] for k in keys})


def _write(fmt, records, directory):
    """``records`` as a file, directory or object of format ``fmt``."""
    directory.mkdir(parents=True, exist_ok=True)
    table = _table(records)
    if fmt == "jsonl":
        path = directory / "data.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        return path
    if fmt == "json-array":
        path = directory / "data.json"
        path.write_text(json.dumps(records))
        return path
    if fmt in ("parquet", "csv", "json"):
        path = directory / f"data.{fmt}"
        getattr(table, f"to_{fmt}")(str(path), **({"index": False} if fmt == "csv" else {}))
        return path
    if fmt == "saved":
        table.save_to_disk(directory / "saved")
        return directory / "saved"
    if fmt == "arrow":  # the stream format that datasets writes (save_to_disk, caches)
        table.save_to_disk(directory / "saved-for-arrow")
        return shutil.copy(next((directory / "saved-for-arrow").glob("*.arrow")), directory / "data.arrow")
    if fmt == "arrow-ipc-file":  # the Arrow IPC file format (Feather v2), as pyarrow and pandas write it
        from pyarrow import feather

        feather.write_feather(table.data.table, str(directory / "data.arrow"), compression="uncompressed")
        return directory / "data.arrow"
    if fmt == "Dataset":
        return table
    assert fmt == "DatasetDict"
    return datasets.DatasetDict({"train": table, "test": _table(records[:3])})


def _data(train_files, pretrained, **kwargs):
    # RECORDS holds 2 unusable records of 30 on purpose (counted alike in every format): past the default share
    kwargs = {"val_fraction": 0.2, "seq_len": 48, "batch_size": 4, "max_skipped_fraction": 1.0, **kwargs}
    data = TextDataModule(train_files=train_files, tokenizer=str(pretrained), **kwargs)
    data.setup("fit")
    return data


def _batches(data, epoch=1):
    loader = data.train_dataloader()
    loader.sampler.set_epoch(epoch)
    return [{k: v.tolist() for k, v in b.items()} for b in loader]


def _in_the_table(rows):
    """Whether ``rows`` are views (``Subset``, ``ConcatDataset``) of the Arrow table's samples and of the ``text``
    blocks cut from its records when read: no row is copied out of it."""
    if isinstance(rows, torch.utils.data.Subset):
        return _in_the_table(rows.dataset)
    if isinstance(rows, torch.utils.data.ConcatDataset):
        return all(_in_the_table(part) for part in rows.datasets)
    if isinstance(rows, TextBlocks):
        return isinstance(rows.documents, TableDocuments)
    return isinstance(rows, TokenRows)


def _token_rows(rows):
    """The ``TokenRows`` behind the views ``rows`` are."""
    if isinstance(rows, torch.utils.data.Subset):
        return _token_rows(rows.dataset)
    if isinstance(rows, torch.utils.data.ConcatDataset):
        return next(_token_rows(part) for part in rows.datasets if not isinstance(part, TextBlocks))
    return rows


def _first_loss(data, pretrained):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(pretrained).eval()
    loader = data.train_dataloader()
    loader.sampler.set_epoch(0)
    with torch.no_grad():
        return model(**next(iter(loader))).loss


@pytest.fixture(scope="module")
def reference(pretrained, tmp_path_factory):
    """What the .jsonl file gives: batches of two epochs, validation rows, first loss, the report."""
    data = _data(_write("jsonl", RECORDS, tmp_path_factory.mktemp("jsonl")), pretrained)
    return data, _batches(data, 0) + _batches(data, 1), rows_as_lists(data.val_set), _first_loss(data, pretrained)


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_gives_the_batches_and_first_loss_of_the_jsonl_file(
    fmt, reference, pretrained, tmp_path, monkeypatch
):
    monkeypatch.setattr(token_table, "MAP_BATCH_SIZE", 4)  # text blocks span Dataset.map's batches
    expected, batches, val_rows, loss = reference
    data = _data(_write(fmt, RECORDS, tmp_path), pretrained)
    assert _batches(data, 0) + _batches(data, 1) == batches
    assert rows_as_lists(data.val_set) == val_rows
    assert _first_loss(data, pretrained) == loss
    (report,) = data.reports
    assert report.used == expected.reports[0].used == 28 and report.bad == expected.reports[0].bad
    # the same records, numbered by row index (from 0) instead of line (from 1)
    assert {k: [r + 1 for r in rows] for k, rows in report.first_lines.items()} == expected.reports[0].first_lines
    assert "(row indices [20])" in report.describe()
    assert _in_the_table(data.train_set) and _in_the_table(data.val_set)  # the held-out split is a view, not a copy


@pytest.mark.parametrize("fmt", ["parquet", "json", "arrow", "saved", "Dataset"])
def test_chats_in_every_format_give_the_samples_of_the_jsonl_file(fmt, pretrained, tmp_path):
    expected = rows_as_lists(_data(_write("jsonl", CHATS, tmp_path / "jsonl"), pretrained, seq_len=64).train_set)
    assert rows_as_lists(_data(_write(fmt, CHATS, tmp_path / fmt), pretrained, seq_len=64).train_set) == expected


def test_chats_stored_as_json_text_in_a_csv_give_the_samples_of_the_jsonl_file(pretrained, tmp_path):
    """A CSV cell holds text: the turns stored as JSON text are read as the list they are."""
    expected = rows_as_lists(_data(_write("jsonl", CHATS, tmp_path / "jsonl"), pretrained, seq_len=64).train_set)
    as_text = [{"messages": json.dumps(record["messages"])} for record in CHATS]
    assert rows_as_lists(_data(_write("csv", as_text, tmp_path / "csv"), pretrained, seq_len=64).train_set) == expected
    not_json = [{"messages": "[not JSON"}, *as_text]
    data = _data(_write("csv", not_json, tmp_path / "bad"), pretrained, seq_len=64)
    reason = "records whose 'messages' is not a list of {role, content} turns (not a non-empty list of turns)"
    assert data.reports[0].bad == {reason: 1}


@pytest.fixture(scope="module")
def tool_tokenizer(pretrained, tmp_path_factory):
    """The tokenizer with a template that tests ``is defined``, as Llama 3.1's does for ``tool_calls``: the None a
    table holds where a turn lacks a key must render as the ``.jsonl`` file's absent key."""
    template = (
        "{% if tools is not none %}<|tools|>{{ tools[0].function.name }}</s>\n{% endif %}{% for m in messages %}"
        "<|{{ m.role }}|>\n{% if m.tool_calls is defined %}call {{ m.tool_calls[0].function.name }}"
        "{% else %}{{ m.content }}{% endif %}</s>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    directory = tmp_path_factory.mktemp("tool_tokenizer")
    save_with_template(pretrained, template, directory)
    return directory


@pytest.mark.parametrize("fmt", ["parquet", "json", "saved", "Dataset"])
def test_conversational_records_in_every_format_give_the_samples_of_the_jsonl_file(fmt, tool_tokenizer, tmp_path):
    jsonl = _data(_write("jsonl", CONVERSATIONAL, tmp_path / "jsonl"), tool_tokenizer, seq_len=96, val_fraction=0)
    expected = rows_as_lists(jsonl.train_set)
    assert jsonl.reports[0].used == len(expected) == len(CONVERSATIONAL)
    called = jsonl.tokenizer.decode(expected[-1]["input_ids"])
    tool_call = "<|user|>\n1 + 1?</s>\n<|assistant|>\ncall add</s>\n<|tool|>\n2</s>\n<|assistant|>\n2.</s>\n"
    assert called == "<|tools|>add</s>\n" + tool_call
    data = _data(_write(fmt, CONVERSATIONAL, tmp_path / fmt), tool_tokenizer, seq_len=96, val_fraction=0)
    assert rows_as_lists(data.train_set) == expected


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_one_tool_schema_outside_a_list_gives_the_samples_of_a_list_of_one(fmt, tool_tokenizer, tmp_path):
    """LLaMA-Factory v1 takes ``tools`` that parse to one schema as a list of it; a dict, or a JSON string of one,
    was refused ("one schema, not a list of them")."""
    listed = {**CONVERSATIONAL[-1], "tools": [TOOL]}
    expected = _data(_write("jsonl", [listed], tmp_path / "listed"), tool_tokenizer, seq_len=96, val_fraction=0)
    assert expected.tokenizer.decode(expected.train_set[0]["input_ids"]).startswith("<|tools|>add</s>")
    for i, alone in enumerate((TOOL, json.dumps(TOOL), TOOL["function"])):  # LLaMA-Factory's bare schema too
        records = [{**listed, "tools": alone}]
        data = _data(_write(fmt, records, tmp_path / f"{fmt}{i}"), tool_tokenizer, seq_len=96, val_fraction=0)
        assert rows_as_lists(data.train_set) == rows_as_lists(expected.train_set)


@pytest.mark.parametrize("fmt", ["parquet", "Dataset"])
def test_alpaca_records_in_a_table_give_the_samples_of_the_jsonl_file(fmt, pretrained, tmp_path):
    jsonl = _data(_write("jsonl", ALPACA, tmp_path / "jsonl"), pretrained, seq_len=64, val_fraction=0)
    assert jsonl.reports[0].used == len(ALPACA)
    data = _data(_write(fmt, ALPACA, tmp_path / fmt), pretrained, seq_len=64, val_fraction=0)
    assert rows_as_lists(data.train_set) == rows_as_lists(jsonl.train_set)


def test_packing_a_parquet_file_gives_the_rows_of_the_jsonl_file(pretrained, tmp_path, monkeypatch):
    monkeypatch.setattr(token_table, "MAP_BATCH_SIZE", 4)
    expected = _data(_write("jsonl", RECORDS, tmp_path / "j"), pretrained, packing=True)
    reads = []
    read_row = TokenRows.__getitem__
    monkeypatch.setattr(TokenRows, "__getitem__", lambda rows, i: reads.append(i) or read_row(rows, i))
    data = _data(_write("parquet", RECORDS, tmp_path / "p"), pretrained, packing=True)
    assert reads == []  # packing took the lengths and the text blocks from the Arrow columns, not from the rows
    assert len(data.train_set) == len(expected.train_set)
    assert isinstance(data.train_set.samples.dataset, TokenRows)  # packed by index: the rows stay in Arrow
    for packed in (data.train_set, data.val_set):
        assert packed.lengths == [len(s["input_ids"]) for s in packed.samples]
        assert packed.ready_lengths == [len(r["input_ids"]) for r in packed.ready]
    assert data.train_set.row_lengths() == expected.train_set.row_lengths()
    for epoch in (0, 1):
        assert _batches(data, epoch) == _batches(expected, epoch)
    assert rows_as_lists(data.val_set) == rows_as_lists(expected.val_set)


def test_workers_read_the_memory_mapped_rows(pretrained, tmp_path):
    path = _write("parquet", RECORDS, tmp_path)
    batches = [_batches(_data(path, pretrained, num_workers=workers)) for workers in (0, 1)]
    assert batches[0] == batches[1] and len(batches[0]) == 7


def test_a_field_mapping_equals_the_renamed_file(pretrained, tmp_path, caplog):
    renamed = [{"question": r["prompt"], "answer": r["completion"], "id": i} for i, r in enumerate(RECORDS[:14])]
    expected = _batches(_data(_write("jsonl", RECORDS[:14], tmp_path / "pc"), pretrained))
    fields = {"prompt": "question", "completion": "answer"}
    for fmt in ("parquet", "jsonl", "Dataset"):
        with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
            assert _batches(_data(_write(fmt, renamed, tmp_path / fmt), pretrained, fields=fields)) == expected
        assert f"fields={fields} leaves the columns ['id'] unread." in caplog.text  # named, not lost in silence
        caplog.clear()
    text = [{"content": r["text"], "prompt": "ignored: not named by the mapping"} for r in RECORDS[14:20]]
    expected = rows_as_lists(_data(_write("jsonl", RECORDS[14:20], tmp_path / "text"), pretrained).train_set)
    data = _data(_write("parquet", text, tmp_path / "content"), pretrained, fields={"text": "content"})
    assert rows_as_lists(data.train_set) == expected


def test_sharegpt_conversations_read_as_messages(pretrained, tmp_path):
    roles = {"user": "human", "assistant": "gpt", "system": "system"}
    sharegpt = [
        {"conversations": [{"from": roles[m["role"]], "value": m["content"]} for m in r["messages"]]} for r in CHATS
    ]
    expected = rows_as_lists(_data(_write("jsonl", CHATS, tmp_path / "chat"), pretrained, seq_len=64).train_set)
    for fmt in ("parquet", "jsonl"):
        assert rows_as_lists(_data(_write(fmt, sharegpt, tmp_path / fmt), pretrained, seq_len=64).train_set) == expected
    dialog = [{"dialog": r["conversations"]} for r in sharegpt]
    data = _data(_write("parquet", dialog, tmp_path / "dialog"), pretrained, seq_len=64, fields={"messages": "dialog"})
    assert rows_as_lists(data.train_set) == expected


def test_a_sharegpt_system_column_is_the_first_turn(pretrained, tmp_path):
    """LLaMA-Factory's ShareGPT format keeps the system prompt in a ``system`` column beside ``conversations``;
    it was dropped, and the chats trained without it. A system turn of the conversation's own comes first."""
    roles = {"user": "human", "assistant": "gpt", "system": "system"}
    sharegpt, as_messages = [], []
    for i, chat in enumerate(CHATS):
        turns = [{"from": roles[m["role"]], "value": m["content"]} for m in chat["messages"]]
        own = chat["messages"][0]["role"] == "system"
        sharegpt.append({"conversations": turns, "system": "Not read: the chat has its own." if own else f"S{i}"})
        system = [] if own else [{"role": "system", "content": f"S{i}"}]
        as_messages.append({"messages": [*system, *chat["messages"]]})
    expected = rows_as_lists(_data(_write("jsonl", as_messages, tmp_path / "chat"), pretrained, seq_len=64).train_set)
    for fmt in ("parquet", "jsonl"):
        assert rows_as_lists(_data(_write(fmt, sharegpt, tmp_path / fmt), pretrained, seq_len=64).train_set) == expected


ADD_CALL = {"name": "add", "arguments": {"a": 1, "b": 1}}
ANSWER = {"from": "gpt", "value": "2"}
ADD_TOOLS = json.dumps([{"type": "function", "function": {"name": "add", "description": "sum", "parameters": {}}}])


def test_sharegpt_tool_use_turns_read_as_llama_factory_reads_them(tool_tokenizer, tmp_path):
    """LLaMA-Factory's ``function_call``/``observation`` turns were passed on under their own names: the template
    wrote ``<|function_call|>``, a role the model never meets, and the call trained as the text of no answer."""
    turns = [("human", "1 + 1?"), ("function_call", json.dumps(ADD_CALL)), ("observation", "2"), ("gpt", "2.")]
    sharegpt = [{"conversations": [{"from": role, "value": value} for role, value in turns], "tools": ADD_TOOLS}]
    call = {"role": "assistant", "tool_calls": [{"type": "function", "function": ADD_CALL}]}
    as_messages = [
        {"role": "user", "content": "1 + 1?"},
        call,
        {"role": "tool", "content": "2"},
        {"role": "assistant", "content": "2."},
    ]
    expected = _data(
        _write("jsonl", [{"messages": as_messages, "tools": ADD_TOOLS}], tmp_path / "messages"),
        tool_tokenizer,
        seq_len=96,
        val_fraction=0,
    )
    for fmt in ("jsonl", "parquet"):
        data = _data(_write(fmt, sharegpt, tmp_path / fmt), tool_tokenizer, seq_len=96, val_fraction=0)
        assert rows_as_lists(data.train_set) == rows_as_lists(expected.train_set)
    labels = [t for t in data.train_set[0]["labels"].tolist() if t != -100]
    assert data.tokenizer.decode(labels) == "call add</s>2.</s>"  # the call trained, the observation context
    several = json.dumps([ADD_CALL, {**ADD_CALL, "name": "mul"}])  # LLaMA-Factory's several calls in one turn,
    # read as two tool_calls; this template writes only the first, which is said, not trained without the second
    turns[1] = ("function_call", several)
    record = {"conversations": [{"from": role, "value": value} for role, value in turns]}
    with pytest.raises(ValueError, match=r"1 record with an assistant tool call \('mul'\) the chat template does"):
        _data(_write("jsonl", [record], tmp_path / "several"), tool_tokenizer, seq_len=96)  # it writes the first


def test_a_role_the_template_does_not_name_is_refused_naming_it_and_the_rename(pretrained, tmp_path):
    """Roles outside system/user/assistant/tool went to the template as they were: a generic template wrote them as
    roles of their own (``<|human|>`` beside ``<|assistant|>``), and the model learnt roles it never meets."""
    bad = [
        {"conversations": [{"from": "human", "value": "hi"}, {"from": "bing", "value": "hello"}, ANSWER]},
        {"messages": [{"role": "usr", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
        {"conversations": [{"from": "human", "value": "1+1?"}, {"from": "function_call", "value": "add(1)"}, ANSWER]},
    ]
    good = [{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}]
    data = _data(_write("jsonl", bad + good, tmp_path / "all"), pretrained, seq_len=64, val_fraction=0)
    reasons = {reason: lines for reason, lines in data.reports[0].bad.items()}
    assert data.reports[0].used == 1 and len(reasons) == 3, reasons
    said = data.reports[0].describe()
    assert "1 record with turns of role 'bing', which the chat template does not name" in said
    assert "rename the role 'bing' to 'assistant'" in said and "rename the role 'usr' to 'user'" in said
    assert "role 'function_call'" in said and "write each call as an assistant turn's tool_calls" in said
    with pytest.raises(ValueError, match=r"turns of role 'bing'.*max_skipped_fraction=0.05"):
        _data(_write("jsonl", bad[:1] + good * 3, tmp_path / "refused"), pretrained, max_skipped_fraction=0.05)


def test_human_and_gpt_roles_in_role_content_turns_read_as_user_and_assistant(pretrained, tmp_path):
    """ShareGPT's role names under ``role``/``content`` keys (axolotl's chat_template renames them by default,
    ``roles: {user: [human, user], assistant: [gpt, assistant]}``) were refused as unknown roles: every record of
    such a file was unusable. Only those two are renamed; any other role is refused as before, with its rename."""
    renamed = {"user": "human", "assistant": "gpt"}

    def aliased(turns):
        return [t | {"role": renamed.get(t["role"], t["role"])} for t in turns]

    chats = [{"messages": aliased(c["messages"])} for c in CHATS]
    conversational = [{"prompt": aliased(c["prompt"]), "completion": aliased(c["completion"])} for c in CONVERSATIONAL]
    expected = _data(_write("jsonl", CHATS, tmp_path / "chat"), pretrained, seq_len=64, val_fraction=0)
    data = _data(_write("jsonl", chats, tmp_path / "aliased"), pretrained, seq_len=64, val_fraction=0)
    assert data.reports[0].used == len(CHATS)
    assert rows_as_lists(data.train_set) == rows_as_lists(expected.train_set)
    expected = _data(_write("jsonl", CONVERSATIONAL, tmp_path / "pc"), pretrained, seq_len=96, val_fraction=0)
    data = _data(_write("parquet", conversational, tmp_path / "pc-aliased"), pretrained, seq_len=96, val_fraction=0)
    assert rows_as_lists(data.train_set) == rows_as_lists(expected.train_set)
    other = [{"messages": [{"role": "Human", "content": "hi"}, {"role": "gpt", "content": "hello"}]}]
    data = _data(_write("jsonl", other + CHATS[:3], tmp_path / "other"), pretrained, seq_len=64, val_fraction=0)
    assert "turns of role 'Human'" in data.reports[0].describe() and data.reports[0].used == 3


def test_a_turn_or_tool_call_the_template_does_not_write_is_refused(pretrained, tmp_path):
    """A template that names its roles writes nothing for another (a tool's answer, as Zephyr's drops it), and one
    that writes ``content`` only drops an assistant's ``tool_calls``: the record trained without them."""
    named = (
        "{% for m in messages %}{% if m.role == 'user' %}<|user|>\n{{ m.content }}</s>\n"
        "{% elif m.role == 'assistant' %}<|assistant|>\n{{ m.content }}</s>\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    save_with_template(pretrained, named, tmp_path / "named")
    call = {"role": "assistant", "tool_calls": [{"type": "function", "function": ADD_CALL}]}
    records = [
        {"messages": [{"role": "user", "content": "1+1?"}, {"role": "tool", "content": "two"}, call]},
        {"messages": [{"role": "user", "content": "1+1?"}, call]},
        {"messages": [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2"}]},
    ]
    data = _data(_write("jsonl", records, tmp_path / "chat"), tmp_path / "named", seq_len=64, val_fraction=0)
    said = data.reports[0].describe()
    assert data.reports[0].used == 1, said
    assert "1 record with a 'tool' turn whose text the chat template does not write" in said
    assert "1 record with an assistant tool call ('add') the chat template does not write" in said


def test_a_column_of_numbers_is_named_as_such(pretrained, tmp_path):
    """A Parquet answer column of integers (GSM8K-style) was told only "not both strings"."""
    records = [{"prompt": f"{i} + 1 =", "completion": i + 1} for i in range(4)]
    with pytest.raises(ValueError) as error:
        _data(_write("parquet", records, tmp_path), pretrained)
    assert (
        "not both strings or both lists of turns (prompt: str, completion: int): a number is not text; store that"
        " column as strings (row indices [0, 1, 2" in str(error.value)
    )


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_a_mapping_naming_a_missing_column_is_refused_with_the_columns(fmt, pretrained, tmp_path, caplog):
    path = _write(fmt, [{"question": "q", "answer_text": "a"}], tmp_path)
    with caplog.at_level(logging.INFO), pytest.raises(ValueError) as error:
        _data(path, pretrained, fields={"prompt": "question", "completion": "answer"})
    assert "skipped" not in caplog.text  # the refusal alone, not a line counting every record unusable first
    assert f"{path}: fields={{'prompt': 'question', 'completion': 'answer'}} names the column(s) ['answer']" in str(
        error.value
    )
    assert "its columns are ['answer_text', 'question']" in str(error.value)


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_a_table_with_no_column_to_read_is_refused_with_a_mapping_example(fmt, pretrained, tmp_path, caplog):
    """The same for the most common format, .jsonl, whose records were only counted as unusable."""
    path = _write(fmt, [{"question": "q", "answer": "a"}], tmp_path)
    with (
        caplog.at_level(logging.INFO),
        pytest.raises(ValueError, match=r"has the columns \['answer', 'question'\], none of which .*fields="),
    ):
        _data(path, pretrained)
    assert "skipped" not in caplog.text  # no line counting every record as unusable before the refusal


def test_a_json_object_with_its_records_under_a_key_reads_them(pretrained, tmp_path, caplog):
    """SQuAD-style ``{"version": 1, "data": [...]}``: the records under the one key that lists them, as
    ``load_dataset("json", field="data")`` reads them; a one-record chat file is still one record."""
    expected = rows_as_lists(
        _data(_write("jsonl", RECORDS[:14], tmp_path / "jsonl"), pretrained, val_fraction=0).train_set
    )
    nested = tmp_path / "squad.json"
    nested.write_text(json.dumps({"version": 1, "data": RECORDS[:14]}))
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        data = _data(nested, pretrained, val_fraction=0)
    assert rows_as_lists(data.train_set) == expected
    assert "squad.json: one JSON object; read the records listed under its key 'data'; not read: ['version']." in (
        caplog.text
    )
    renamed = tmp_path / "renamed.json"
    renamed.write_text(json.dumps({"rows": [{"q": r["prompt"], "a": r["completion"]} for r in RECORDS[:14]]}))
    fields = {"prompt": "q", "completion": "a"}
    assert rows_as_lists(_data(renamed, pretrained, val_fraction=0, fields=fields).train_set) == expected
    one_chat = tmp_path / "chat.json"
    one_chat.write_text(json.dumps(CHATS[0]))  # a list of turns under "messages": a record, not a list of them
    assert len(_data(one_chat, pretrained, val_fraction=0, seq_len=64).train_set) == 1
    several = tmp_path / "splits.json"
    several.write_text(json.dumps({"train": RECORDS[:4], "test": RECORDS[4:6], "sizes": [4, 2]}))
    with pytest.raises(
        ValueError,
        match=r"splits\.json is one JSON object with lists of records under the keys"
        r" \['train', 'test'\]; which to read is not clear\. .*d\['train'\]",
    ):
        _data(several, pretrained)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"prompt": "question"}, r"\['prompt'\] is not one format"),
        ({"answer": "a", "prompt": "q"}, r"\['answer'\] are not fields it reads"),
        ({"text": 3}, r"must map field names to column names"),
    ],
)
def test_bad_fields_are_refused_when_built(fields, match, pretrained, tmp_path):
    with pytest.raises(ValueError, match=match):
        TextDataModule(train_files=_write("jsonl", RECORDS, tmp_path), tokenizer=str(pretrained), fields=fields)


def test_truncation_is_reported_and_refused_as_for_jsonl(pretrained, tmp_path):
    long = [{"prompt": "def f(x):\n    return", "completion": " x + 1" * 10} for _ in range(5)]
    messages = {}
    for fmt in ("jsonl", "parquet"):
        path = _write(fmt, long, tmp_path / fmt)
        with pytest.raises(ValueError) as error:
            _data(path, pretrained)
        messages[fmt] = str(error.value).replace(str(path), "PATH")
    assert messages["jsonl"] == messages["parquet"]
    assert "seq_len=48 cuts 5 samples" in messages["parquet"]


SHAREGPT = [{"conversations": [{"from": "human", "value": "Hi?"}, {"from": "gpt", "value": "Hello."}]}]


@pytest.mark.parametrize(
    ("fmt", "records", "said"),
    [
        ("parquet", CHATS, r", row 0: 'messages' records are chat turns, which need a chat template"),
        ("jsonl", ALPACA, r", line 1: alpaca records \(instruction, output\) are read as chat turns, which need"),
        ("jsonl", SHAREGPT, r", line 1: ShareGPT records \(conversations\) are chat turns, which need"),
    ],
)
def test_chat_records_need_a_chat_template(fmt, records, said, pretrained, tmp_path):
    """The refusal names the file, the record and its format (alpaca and ShareGPT users never wrote 'messages')."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(pretrained)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(tmp_path / "plain")
    for template in tmp_path.joinpath("plain").glob("chat_template.*"):
        template.unlink()
    path = _write(fmt, records, tmp_path)
    data = TextDataModule(train_files=path, tokenizer=str(tmp_path / "plain"))
    with pytest.raises(ValueError, match=rf"{re.escape(str(path))}{said}.* has none. Use a chat model's tokenizer"):
        data.setup("fit")


def test_nothing_is_written_beside_the_data_and_tokens_stay_memory_mapped(pretrained, tmp_path):
    for fmt in ("arrow", "saved"):
        path = _write(fmt, RECORDS, tmp_path / fmt)
        before = sorted(p.name for p in path.parent.rglob("*"))
        data = _data(path, pretrained, val_fraction=0)
        assert sorted(p.name for p in path.parent.rglob("*")) == before
        table = _token_rows(data.train_set).table
        (cache,) = table.cache_files  # the tokens: one Arrow file, in datasets' temporary directory
        assert cache["filename"].startswith(datasets.fingerprint.get_temporary_cache_files_directory())
        assert set(table.column_names) == {"input_ids", "labels", "document"}


def test_a_directory_reads_every_format_and_refuses_several_splits(pretrained, tmp_path):
    _write("jsonl", RECORDS[:10], tmp_path / "mixed")
    _write("parquet", RECORDS[10:], tmp_path / "mixed")
    _table(CHATS).save_to_disk(tmp_path / "mixed" / "chats")
    (tmp_path / "mixed" / "README.md").write_text("notes")
    (tmp_path / "mixed" / "dataset_infos.json").write_text('{"default": {"description": "metadata, not records"}}')
    data = _data(tmp_path / "mixed", pretrained, seq_len=64)
    assert [(s.kind, s.path.name) for s in data.train_sources] == [
        ("saved", "chats"),
        ("native", "data.jsonl"),
        ("file", "data.parquet"),
    ]
    assert [r.used for r in data.reports] == [10, 10, 18]

    hub_layout = tmp_path / "repo" / "data"
    hub_layout.mkdir(parents=True)
    _table(RECORDS[:8]).to_parquet(str(hub_layout / "train-00000-of-00001.parquet"))
    _table(RECORDS[20:]).to_parquet(str(hub_layout / "test-00000-of-00001.parquet"))
    with pytest.raises(ValueError) as error:
        TextDataModule(train_files=tmp_path / "repo", tokenizer=str(pretrained))
    assert "holds the files of several splits (test: 1, train: 1 files)" in str(error.value)
    assert f"train_files='{hub_layout}/train*.parquet', and another's as val_files." in str(error.value)
    with pytest.raises(ValueError) as error:  # the same files matched by a glob: trained on without a word
        TextDataModule(train_files=str(hub_layout / "*.parquet"), tokenizer=str(pretrained))
    assert f"'{hub_layout}/*.parquet' matches the files of several splits (test: 1, train: 1 files)" in str(error.value)
    with pytest.raises(ValueError) as error:
        TextDataModule(
            train_files=str(hub_layout / "train-*.parquet"), val_files=str(tmp_path / "repo"), tokenizer=str(pretrained)
        )
    said = str(error.value)
    assert f"val_files='{hub_layout}/test*.parquet', and the training split's as train_files." in said
    data = _data(str(hub_layout / "train-*.parquet"), pretrained, val_files=str(hub_layout / "test-*.parquet"))
    assert [r.used for r in data.reports] == [8, 8]
    with pytest.raises(ValueError, match=r"'.*nothing-\*.parquet' matches no file"):
        TextDataModule(train_files=str(tmp_path / "nothing-*.parquet"), tokenizer=str(pretrained))


def test_a_dataset_dict_gives_the_split_asked_for(pretrained, tmp_path):
    splits = datasets.DatasetDict({"train": _table(RECORDS[:14]), "test": _table(RECORDS[20:])})
    data = _data(splits, pretrained, val_files=splits)
    assert [r.path for r in data.reports] == [
        "the DatasetDict given as train_files (split 'train')",
        "the DatasetDict given as val_files (split 'test')",
    ]
    assert (len(data.train_set), len(data.val_set)) == (14, 8)
    splits.save_to_disk(tmp_path / "saved")
    data = _data(tmp_path / "saved", pretrained, val_files=tmp_path / "saved", train_split="test", val_split="train")
    assert (len(data.train_set), len(data.val_set)) == (8, 14)
    with pytest.raises(
        ValueError, match=r"has the splits \['train', 'test'\], and none of \['dev'\]. .*val_split=NAME"
    ):
        _data(splits, pretrained, val_files=splits, val_split="dev")


def test_a_split_named_for_sources_without_splits_is_refused(pretrained, tmp_path):
    """A file or a single Dataset is one split, 'train', as datasets.load_dataset reads it; train_split='test' or
    val_split='validation' on one was ignored without a word, and the whole file trained (or validated)."""
    path = _write("jsonl", RECORDS, tmp_path)
    held_out = _write("jsonl", RECORDS[20:], tmp_path / "held_out")
    for split_argument in ({"train_split": "test"}, {"train_split": "validation", "val_files": held_out}):
        with pytest.raises(ValueError) as error:
            TextDataModule(train_files=path, tokenizer=str(pretrained), **split_argument)
        said = str(error.value)
        option, value = next(iter(split_argument.items()))
        assert (
            said.startswith(f"TextDataModule({option}={value!r}): train_files ({path}) has no splits")
            and (f"Fix: leave {option} out (a file is read whole), or name the {value!r} split's own files as") in said
        )
    with pytest.raises(ValueError, match=r"^TextDataModule\(train_split='test'\): train_files \(the Dataset given"):
        TextDataModule(train_files=_table(RECORDS), tokenizer=str(pretrained), train_split="test")
    with pytest.raises(ValueError, match=r"^TextDataModule\(val_split='validation'\): val_files \(.*held_out"):
        TextDataModule(train_files=path, val_files=held_out, tokenizer=str(pretrained), val_split="validation")
    with pytest.raises(ValueError) as error:  # no val_files: the split of train_files' dataset dicts, and none here
        TextDataModule(train_files=path, tokenizer=str(pretrained), val_split="validation")
    assert "without val_files reads that split of train_files' dataset dicts, and train_files" in str(error.value)
    assert "Fix: give the validation records as val_files (--data.val_files FILE)" in str(error.value)
    data = _data(path, pretrained, val_files=held_out, train_split="train", val_split="train")  # datasets' one split
    assert [r.used for r in data.reports] == [28, 8]


def test_val_split_without_val_files_validates_on_that_split_of_the_training_dataset_dict(pretrained, tmp_path):
    """As TRL's scripts read dataset_test_split of the one dataset_name; it held out val_fraction instead."""
    splits = datasets.DatasetDict({"train": _table(RECORDS[:14]), "test": _table(RECORDS[20:])})
    for train_files in (splits, splits.save_to_disk(tmp_path / "saved") or tmp_path / "saved"):
        data = _data(train_files, pretrained, val_split="test")
        assert (len(data.train_set), len(data.val_set)) == (14, 8)
        assert data.reports[1].path.endswith("given as train_files (split 'test')") or data.reports[1].path == (
            f"{tmp_path / 'saved'} (split 'test')"
        )


def test_a_hub_id_is_loaded_with_load_dataset_and_offline_says_what_to_do(pretrained, monkeypatch):
    """Only the wiring: these machines have no network, so load_dataset is replaced."""
    splits = datasets.DatasetDict({"train": _table(RECORDS[:14])})
    monkeypatch.setattr(datasets, "load_dataset", lambda name: splits if name == "org/instructions" else None)
    data = _data("org/instructions", pretrained, val_fraction=0)
    assert data.reports[0].path == "hub dataset 'org/instructions' (split 'train')" and len(data.train_set) == 14

    def offline(name):
        raise ConnectionError("no network")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(ValueError, match=r"'org/instructions' is not a local file or directory, and loading it .*"):
        _data("org/instructions", pretrained)


def test_a_mistyped_local_path_is_no_hub_id_and_names_the_file_meant(pretrained, tmp_path, monkeypatch):
    """``data/pc.parqet`` where ``data/`` is here: a local file misspelled, not a dataset to look for on the Hub."""
    (tmp_path / "data").mkdir()
    _table(RECORDS).to_parquet(tmp_path / "data/pc.parquet")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: pytest.fail("the Hub was asked"))
    with pytest.raises(ValueError, match=r"'data/pc.parqet' does not exist \(did you mean 'data/pc.parquet'\?\)"):
        TextDataModule(train_files="data/pc.parqet", tokenizer=str(pretrained))


def test_a_dataset_object_is_described_not_saved_in_the_hyperparameters(pretrained):
    table = _table(RECORDS)
    data = TextDataModule(train_files=table, tokenizer=str(pretrained), val_files=[table])
    assert data.hparams.train_files == f"Dataset(num_rows=30, fingerprint={table._fingerprint})"
    assert data.hparams.val_files == [data.hparams.train_files]
    with pytest.raises(TypeError, match=r"a streaming IterableDataset has no length"):
        TextDataModule(train_files=table.to_iterable_dataset(), tokenizer=str(pretrained))
    with pytest.raises(TypeError, match=r"train_files=dict is neither a path nor a datasets.Dataset"):
        TextDataModule(train_files={"prompt": "x"}, tokenizer=str(pretrained))


def test_without_the_extra_a_parquet_file_is_refused_with_the_install_command(tmp_path, monkeypatch):
    from lightning_utilities.core.imports import RequirementCache

    from pl_lowprec import _imports

    monkeypatch.setattr(_imports, "_DATASETS", RequirementCache("datasets>=999"))
    _imports.import_datasets.cache_clear()
    (tmp_path / "data.parquet").write_bytes(b"")
    try:
        with pytest.raises(ModuleNotFoundError, match=r'Install it with: pip install "pl_lowprec\[datasets\]"'):
            TextDataModule(train_files=tmp_path / "data.parquet", tokenizer="unused")
    finally:
        _imports.import_datasets.cache_clear()


def test_the_command_line_passes_a_csv_path_and_a_field_mapping(tmp_path, capsys, monkeypatch):
    """A class named in train_files' type would make LightningCLI read the file as a config and pass its text."""
    import yaml

    from pl_lowprec.cli import build_cli

    path = tmp_path / "qa.csv"
    path.write_text("question,answer\nq,a\n")  # text that also parses as YAML
    args = [
        "fit",
        "--model=pl_lowprec.models.CausalLM",
        "--model.pretrained=unused",
        "--data=pl_lowprec.data.TextDataModule",
        f"--data.train_files={path}",
        f"--data.val_files=[{path}]",
        "--data.tokenizer=unused",
        "--data.fields={prompt: question, completion: answer}",
        "--print_config",
    ]
    monkeypatch.setattr("sys.argv", ["pl-lowprec"])  # pytest's own arguments are not the CLI's
    with pytest.raises(SystemExit) as exit_info:
        build_cli(args)
    assert exit_info.value.code == 0
    data = yaml.safe_load(capsys.readouterr().out)["data"]["init_args"]
    assert (data["train_files"], data["val_files"]) == (str(path), [str(path)])
    assert data["fields"] == {"prompt": "question", "completion": "answer"}
