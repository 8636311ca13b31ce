"""TextDataModule: the three record formats, the batch contract, the split, and bad records."""

import json

import pytest
import torch
from loading_helpers import save_tokenizer

from pl_lowprec.data import TextDataModule

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return save_tokenizer(tmp_path_factory.mktemp("tok"))


def _jsonl(path, records):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in records) + "\n")
    return path


def _setup(**kwargs):
    data = TextDataModule(**{"val_fraction": 0, **kwargs})
    data.setup("fit")
    return data


def _targets(data, sample):
    return data.tokenizer.decode([t for t in sample["labels"].tolist() if t != -100])


def test_text_is_packed_into_blocks_with_loss_on_every_token(tmp_path, tokenizer_dir):
    (tmp_path / "a.txt").write_text("def add(a, b):\n    return a + b\n" * 40)
    data = _setup(train_files=tmp_path / "a.txt", tokenizer=str(tokenizer_dir), seq_len=16)
    stream = [*data.tokenizer("def add(a, b):\n    return a + b\n" * 40)["input_ids"], data.tokenizer.eos_token_id]
    blocks = data.train_set
    assert [len(b["input_ids"]) for b in blocks[:-1]] == [16] * (len(blocks) - 1)
    assert torch.cat([b["input_ids"] for b in blocks]).tolist() == stream[: sum(len(b["input_ids"]) for b in blocks)]
    assert all(torch.equal(b["input_ids"], b["labels"]) for b in blocks)


def test_prompt_completion_takes_loss_on_the_completion_only(tmp_path, tokenizer_dir):
    path = _jsonl(tmp_path / "pc.jsonl", [{"prompt": "Q: two plus two?\nA:", "completion": " four"}])
    data = _setup(train_files=path, tokenizer=str(tokenizer_dir))
    (sample,) = data.train_set
    assert _targets(data, sample) == " four</s>"
    assert data.tokenizer.decode(sample["input_ids"]) == "<s>Q: two plus two?\nA: four</s>"


def test_messages_take_loss_on_assistant_turns_only(tmp_path, tokenizer_dir):
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi"},
        {"role": "user", "content": "name?"},
        {"role": "assistant", "content": "pl"},
    ]
    data = _setup(train_files=_jsonl(tmp_path / "chat.jsonl", [{"messages": chat}]), tokenizer=str(tokenizer_dir))
    (sample,) = data.train_set
    assert _targets(data, sample) == "hi</s>pl</s>"  # the newline after each turn's </s> is the template's
    assert data.tokenizer.decode(sample["input_ids"]).endswith("pl</s>\n")


def test_batches_follow_the_hugging_face_contract(tmp_path, tokenizer_dir):
    records = [{"prompt": "x" * n, "completion": "y"} for n in (1, 5, 9)]
    data = _setup(train_files=_jsonl(tmp_path / "pc.jsonl", records), tokenizer=str(tokenizer_dir), batch_size=3)
    batch = data._collate()(data.train_set)
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert batch["input_ids"].dtype == batch["labels"].dtype == torch.long
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape
    lengths = batch["attention_mask"].sum(1)
    assert lengths.tolist() == sorted(lengths.tolist()) and lengths[0] < lengths[2]
    padded = batch["attention_mask"] == 0
    assert (batch["labels"][padded] == -100).all() and (batch["input_ids"][padded] == data.tokenizer.pad_token_id).all()


def test_validation_split_is_seeded_and_disjoint(tmp_path, tokenizer_dir):
    path = _jsonl(tmp_path / "pc.jsonl", [{"prompt": f"p{i}", "completion": f" c{i}"} for i in range(20)])
    a = TextDataModule(train_files=path, tokenizer=str(tokenizer_dir), val_fraction=0.2, seed=3)
    b = TextDataModule(train_files=path, tokenizer=str(tokenizer_dir), val_fraction=0.2, seed=3)
    a.setup("fit")
    b.setup("fit")
    assert len(a.val_set) == 4 and len(a.train_set) == 16
    key = lambda s: tuple(s["input_ids"].tolist())  # noqa: E731
    assert [key(s) for s in a.val_set] == [key(s) for s in b.val_set]
    assert not {key(s) for s in a.val_set} & {key(s) for s in a.train_set}


def test_a_held_out_share_far_from_val_fraction_is_said(tmp_path, tokenizer_dir):
    path = _jsonl(tmp_path / "pc.jsonl", [{"prompt": f"p{i}", "completion": f" c{i}"} for i in range(2)])
    data = TextDataModule(train_files=path, tokenizer=str(tokenizer_dir), val_fraction=0.05)
    with pytest.warns(UserWarning, match=r"val_fraction=0\.05\) holds out 1 of 2 samples \(50% of the training data\)"):
        data.setup("fit")
    assert (len(data.train_set), len(data.val_set)) == (1, 1)  # the split itself is unchanged
    one = _jsonl(tmp_path / "one.jsonl", [{"prompt": "p", "completion": " c"}])
    with pytest.warns(UserWarning, match=r"holds out nothing: the training files make 1 sample, so there is no"):
        TextDataModule(train_files=one, tokenizer=str(tokenizer_dir)).setup("fit")


def test_a_held_out_share_near_val_fraction_is_not_said(tmp_path, tokenizer_dir, recwarn):
    path = _jsonl(tmp_path / "pc.jsonl", [{"prompt": f"p{i}", "completion": f" c{i}"} for i in range(20)])
    TextDataModule(train_files=path, tokenizer=str(tokenizer_dir), val_fraction=0.05).setup("fit")  # 1 of 20
    TextDataModule(train_files=path, tokenizer=str(tokenizer_dir), val_fraction=0).setup("fit")
    assert not [w for w in recwarn if "val_fraction" in str(w.message)]


def test_val_files_beside_val_fraction_or_the_training_file_are_said(tmp_path, tokenizer_dir, recwarn):
    records = [{"prompt": f"p{i}", "completion": f" c{i}"} for i in range(4)]
    train = _jsonl(tmp_path / "train.jsonl", records)
    copy = _jsonl(tmp_path / "copy.jsonl", records)
    held_out = _jsonl(tmp_path / "val.jsonl", records[:2])
    kwargs = {"train_files": train, "tokenizer": str(tokenizer_dir)}
    with pytest.warns(UserWarning, match=r"val_fraction=0\.3\) is not used: val_files gives the validation samples"):
        TextDataModule(**kwargs, val_files=held_out, val_fraction=0.3).setup("fit")
    with pytest.warns(UserWarning, match=r"val_files .*train\.jsonl is the training file .*train\.jsonl, so the"):
        TextDataModule(**kwargs, val_files=train).setup("fit")
    with pytest.warns(UserWarning, match=r"val_files .*copy\.jsonl is a copy of the training file .*train\.jsonl"):
        TextDataModule(**kwargs, val_files=[held_out, copy]).setup("fit")
    recwarn.clear()
    TextDataModule(**kwargs, val_files=held_out).setup("fit")
    TextDataModule(**kwargs, val_files=held_out, val_fraction=0).setup("fit")
    assert not [w for w in recwarn if "val_f" in str(w.message)]


def test_bad_records_are_counted_with_their_lines(tmp_path, tokenizer_dir):
    records = [
        {"prompt": "ok", "completion": " yes"},  # 1
        "{not json",  # 2
        {"question": "?"},  # 3
        {"text": "   "},  # 4
        {"prompt": "p", "completion": ""},  # 5
        {"prompt": "only a prompt"},  # 6
        {"messages": [{"role": "user", "content": "no answer"}]},  # 7
        {"prompt": "x " * 200, "completion": " cut away"},  # 8
        {"messages": "hi"},  # 9
        {"prompt": [{"role": "user", "content": "a list"}], "completion": "and a string"},  # 10
        {"prompt": [{"role": "user", "content": "q"}], "completion": [{"content": "no role"}]},  # 11
    ]
    path = _jsonl(tmp_path / "mixed.jsonl", records)
    data = _setup(
        train_files=path, tokenizer=str(tokenizer_dir), seq_len=32, max_truncated_fraction=1.0, max_skipped_fraction=1
    )
    (report,) = data.reports
    assert report.used == 1 and len(data.train_set) == 1
    assert report.first_lines == {
        "invalid JSON": [2],
        "records without a 'text', 'prompt'/'completion' or 'messages' field": [3],
        "records with empty text": [4],
        "records with an empty completion": [5],
        "records with no 'completion' field (they have ['prompt'])": [6],
        "records with no turn of role 'assistant' (roles seen: user)": [7],
        "records with no target tokens within seq_len=32": [8],
        "records with 'prompt' and 'completion' not both strings or both lists of turns (prompt: list,"
        " completion: str)": [10],
        "records whose 'messages' is not a list of {role, content} turns (not a non-empty list of turns)": [9],
        "records whose 'prompt' or 'completion' list is not of {role, content} turns (a turn without a string"
        " 'role')": [11],
    }
    said = report.describe()  # one record, in the singular
    assert "1 record used, 10 skipped: 1 invalid JSON (lines [2]); 1 record without a 'text'" in said
    assert "; 1 record with no target tokens within seq_len=32 (lines [8])" in said


def test_a_file_with_no_usable_record_fails_with_path_and_lines(tmp_path, tokenizer_dir):
    path = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "p"}, "oops"])
    with pytest.raises(
        ValueError,
        match=r"No usable record in .*bad.jsonl: 0 records used, 2 skipped: .*\(lines \[1\]\).*"
        r"invalid JSON \(lines \[2\]\)",
    ):
        _setup(train_files=path, tokenizer=str(tokenizer_dir))


def test_a_byte_order_mark_is_not_a_record_and_a_non_utf8_byte_is_refused_by_line(tmp_path, tokenizer_dir):
    """A .jsonl saved with a UTF-8 BOM lost its first record as 'invalid JSON'; a .txt trained on U+FEFF; a latin-1
    byte was a decode error naming no file, or (.txt) a replacement character trained without a word."""
    records = [{"prompt": "first", "completion": " kept"}, {"prompt": "second", "completion": " kept"}]
    jsonl = tmp_path / "bom.jsonl"
    jsonl.write_bytes(b"\xef\xbb\xbf" + "\n".join(json.dumps(r) for r in records).encode())
    (report,) = _setup(train_files=jsonl, tokenizer=str(tokenizer_dir)).reports
    assert (report.used, dict(report.bad)) == (2, {})
    text = tmp_path / "bom.txt"
    text.write_bytes("\ufeffdef f(x):\n    return x\n".encode())
    (block,) = _setup(train_files=text, tokenizer=str(tokenizer_dir), seq_len=64).train_set
    assert "\ufeff" not in _targets_text(tokenizer_dir, block)
    latin1 = tmp_path / "latin1.jsonl"
    latin1.write_bytes(b'{"text": "ok"}\n{"text": "caf\xe9"}\n')
    message = r"latin1\.jsonl, line 2: byte 0xe9 at column 14 is not UTF-8 .* Re-save the file as UTF-8, e\.g\. iconv"
    with pytest.raises(ValueError, match=message):
        _setup(train_files=latin1, tokenizer=str(tokenizer_dir))
    latin1_text = tmp_path / "notes.txt"
    latin1_text.write_bytes(b"first line\nna\xefve\n")
    with pytest.raises(ValueError, match=r"notes\.txt, line 2: byte 0xef at column 3 is not UTF-8"):
        _setup(train_files=latin1_text, tokenizer=str(tokenizer_dir))


def _targets_text(tokenizer_dir, sample):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir)).decode(sample["input_ids"])


def test_bad_arguments_fail_when_built(tmp_path, tokenizer_dir):
    with pytest.raises(ValueError, match=r"train_files: '.*missing.jsonl' does not exist"):
        TextDataModule(train_files=tmp_path / "missing.jsonl", tokenizer=str(tokenizer_dir))
    (tmp_path / "a.txt").write_text("text")
    with pytest.raises(ValueError, match=r"val_files: .* does not exist.* Or leave val_files out .* val_fraction"):
        TextDataModule(train_files=tmp_path / "a.txt", val_files=tmp_path / "val.jsonl", tokenizer=str(tokenizer_dir))
    (tmp_path / "x.tsv").write_text("a")
    with pytest.raises(ValueError, match=r"is not a file this module reads \('.tsv'\)"):
        TextDataModule(train_files=tmp_path / "x.tsv", tokenizer=str(tokenizer_dir))
    (tmp_path / "a.txt").write_text("text")
    with pytest.raises(ValueError, match=r"tokenizer=./nope. is neither a model directory nor a hub id"):
        _setup(train_files=tmp_path / "a.txt", tokenizer="/nope")


def test_workers_give_the_same_batches(tmp_path, tokenizer_dir):
    path = _jsonl(tmp_path / "pc.jsonl", [{"prompt": f"p{i}", "completion": f" c{i}"} for i in range(10)])
    batches = {}
    for workers in (0, 1):
        data = _setup(train_files=path, tokenizer=str(tokenizer_dir), batch_size=4, num_workers=workers)
        loader = data.train_dataloader()
        loader.sampler.set_epoch(1)
        batches[workers] = [b["input_ids"].tolist() for b in loader]
    assert batches[0] == batches[1] and len(batches[0]) == 3


def _expected_loss(tokenizer, records, seq_len):
    """Target tokens and those past seq_len, counted from the tokenizer directly."""
    total = lost = 0
    ends = []
    for r in records:
        start = len(tokenizer(r["prompt"])["input_ids"])
        n = len(tokenizer(r["completion"], add_special_tokens=False)["input_ids"]) + 1  # and EOS
        positions = range(start, start + n)
        total += n
        lost += sum(p >= seq_len for p in positions)
        ends += positions
    return total, lost, sorted(ends)


def test_truncation_is_reported_by_file_and_refused_past_the_threshold(tmp_path, tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    records = [
        {"prompt": f"def function_{i}(value):\n    " + "x = x + 1\n    " * 2, "completion": " return " + "value + " * 6}
        for i in range(400)
    ]
    lengths = [len(tokenizer(r["prompt"])["input_ids"] + tokenizer(r["completion"])["input_ids"]) for r in records]
    assert min(lengths) > 40  # every sample is longer than seq_len=40
    total, lost, positions = _expected_loss(tokenizer, records, seq_len=40)
    keep_95 = -(-(positions[int(0.95 * total + 0.999999) - 1] + 1) // 8) * 8
    path = _jsonl(tmp_path / "long.jsonl", records)
    with pytest.raises(ValueError) as error:
        _setup(train_files=path, tokenizer=str(tokenizer_dir), seq_len=40)
    message = str(error.value)
    assert f"seq_len=40 cuts 400 samples, losing {lost} of the file's {total} target tokens" in message
    assert f"({lost / total:.1%}), more than max_truncated_fraction=0.05" in message
    assert f"pass --data.seq_len {keep_95}" in message and "--data.max_truncated_fraction" in message

    data = _setup(train_files=path, tokenizer=str(tokenizer_dir), seq_len=40, max_truncated_fraction=1.0)
    assert (
        data.reports[0]
        .describe()
        .endswith(f"400 truncated, losing {lost} of {total} target tokens ({lost / total:.1%})")
    )
    data = _setup(train_files=path, tokenizer=str(tokenizer_dir), seq_len=keep_95)  # the suggestion is accepted
    assert data.reports[0].lost_share() <= 0.05


def test_a_directory_with_records_in_other_formats_lists_them(tmp_path, tokenizer_dir):
    _jsonl(tmp_path / "a.jsonl", [{"prompt": "p", "completion": " c"}])
    (tmp_path / "b.jsonl.gz").write_bytes(b"")
    (tmp_path / "c.tsv").write_text("prompt\tcompletion\np\t c\n")
    with pytest.raises(ValueError, match=r"holds files this module does not read \(1 .gz, 1 .tsv\) beside 1 "):
        TextDataModule(train_files=tmp_path, tokenizer=str(tokenizer_dir))
    (tmp_path / "b.jsonl.gz").unlink()
    (tmp_path / "c.tsv").unlink()
    (tmp_path / "README.md").write_text("notes")  # not records: read past, and said so
    data = TextDataModule(train_files=tmp_path, tokenizer=str(tokenizer_dir))
    assert [source.path for source in data.train_sources] == [tmp_path / "a.jsonl"]


def test_a_file_with_more_unusable_records_than_max_skipped_fraction_is_refused(tmp_path, tokenizer_dir):
    """Half a file whose answers are under another name trained on the other half, said in one INFO line."""
    records = [
        {"prompt": f"q{i}", "completion": f" a{i}"} if i % 2 else {"prompt": f"q{i}", "answer": f" a{i}"}
        for i in range(6)
    ]
    path = _jsonl(tmp_path / "mixed.jsonl", records)
    with pytest.raises(ValueError) as refused:
        _setup(train_files=path, tokenizer=str(tokenizer_dir))
    message = str(refused.value)
    assert message.startswith(f"{path}: 3 records used, 3 skipped: 3 records with no 'completion' field")
    assert "(lines [1, 3, 5])" in message
    assert "That is 3 unusable records, 50.0% of the file's, more than max_skipped_fraction=0.05" in message
    assert message.endswith("or accept the loss with --data.max_skipped_fraction 0.51.")
    data = _setup(train_files=path, tokenizer=str(tokenizer_dir), max_skipped_fraction=0.51)
    assert len(data.train_set) == 3
    with pytest.raises(ValueError, match=r"TextDataModule\(max_skipped_fraction=1.5\) must be in \[0, 1\]"):
        TextDataModule(train_files=path, tokenizer=str(tokenizer_dir), max_skipped_fraction=1.5)


def test_unusable_records_are_told_what_they_lack(tmp_path, tokenizer_dir):
    """A 'response' column was told "'prompt' and 'completion' not both strings", with no mapping to give; chats
    whose answers have the role 'model' were told to raise seq_len."""
    path = _jsonl(tmp_path / "response.jsonl", [{"prompt": "q", "response": " a"}])
    with pytest.raises(ValueError) as refused:
        _setup(train_files=path, tokenizer=str(tokenizer_dir))
    mapping = "{'prompt': 'prompt', 'completion': 'response'}"
    assert (
        "1 record with no 'completion' field (they have ['prompt', 'response']): map it with"
        f" fields={mapping} (--data.fields '{{prompt: prompt, completion: response}}') (lines [1])"
    ) in str(refused.value)
    data = _setup(train_files=path, tokenizer=str(tokenizer_dir), fields={"prompt": "prompt", "completion": "response"})
    assert _targets(data, data.train_set[0]) == " a</s>"  # the mapping given works

    gemma_style = [{"role": "user", "content": "hi"}, {"role": "model", "content": "hello"}]
    path = _jsonl(tmp_path / "roles.jsonl", [{"messages": gemma_style}])
    with pytest.raises(ValueError) as refused:
        _setup(train_files=path, tokenizer=str(tokenizer_dir))
    assert (
        "1 record with no turn of role 'assistant' (roles seen: user, model): rename the answers' role 'model' to"
        " 'assistant' (lines [1])"
    ) in str(refused.value)
    assert "seq_len" not in str(refused.value)
