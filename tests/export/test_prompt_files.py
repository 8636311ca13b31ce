"""pl-lowprec generate reads its prompts from what TextDataModule trains on: the same records from a .jsonl,
Parquet, CSV, Arrow or a saved DatasetDict, in the user's own column names (``fields``), and refuses what holds no
prompt with the columns it found and the fix."""

import json
from pathlib import Path

import pytest

from pl_lowprec.export.prompt_files import check_prompt_fields, read_prompts

datasets = pytest.importorskip("datasets")

RECORDS = [
    {"prompt": "def add(a, b):", "completion": " return a + b"},
    {"prompt": "def neg(x):", "completion": " return -x"},
    {"prompt": "import"},  # no reference
]
FIELDS = {"prompt": "question", "completion": "answer"}


pytestmark = pytest.mark.usefixtures("datasets_cache_in_tmp")


def jsonl_of(directory: Path, records: list[dict]) -> Path:
    path = directory / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _renamed(records: list[dict]) -> datasets.Dataset:
    """The records under the user's column names, None where a record lacks one (as Arrow holds it)."""
    return datasets.Dataset.from_dict({column: [r.get(field) for r in records] for field, column in FIELDS.items()})


@pytest.mark.parametrize("fmt", ["parquet", "csv", "json", "arrow", "saved"])
def test_a_table_in_its_own_columns_reads_as_the_jsonl_of_the_same_records(tmp_path, fmt):
    jsonl = jsonl_of(tmp_path, RECORDS)
    table = _renamed(RECORDS)
    if fmt == "saved":  # a DatasetDict: its validation split, not its train split
        path = tmp_path / "saved"
        datasets.DatasetDict({"train": _renamed(RECORDS[:1]), "validation": table}).save_to_disk(path)
    elif fmt == "arrow":
        table.save_to_disk(tmp_path / "for-arrow")
        path = next((tmp_path / "for-arrow").glob("*.arrow"))
    else:
        path = tmp_path / f"prompts.{fmt}"
        getattr(table, f"to_{fmt}")(str(path), **({"index": False} if fmt == "csv" else {}))
    expected = read_prompts(jsonl)
    assert [r.get("completion") for r in expected] == [" return a + b", " return -x", None]
    assert read_prompts(path, fields=FIELDS) == expected
    with pytest.raises(ValueError, match=r"none of which holds prompts .* Name yours with --fields '\{prompt: "):
        read_prompts(path)  # the user's columns, unmapped


def test_a_json_object_with_its_records_under_a_key_reads_as_training_reads_it(tmp_path):
    nested = tmp_path / "squad.json"
    nested.write_text(json.dumps({"version": 1, "data": RECORDS}))
    assert read_prompts(nested) == read_prompts(jsonl_of(tmp_path, RECORDS))


def test_sharegpt_and_alpaca_records_read_as_chats_as_training_reads_them(tmp_path):
    sharegpt = {"conversations": [{"from": "human", "value": "2 + 3?"}, {"from": "gpt", "value": "5"}]}
    alpaca = {"instruction": "Add.", "input": "2 and 3", "output": "5"}
    path = tmp_path / "chats.parquet"
    datasets.Dataset.from_list([sharegpt]).to_parquet(str(path))
    (alpaca_file := tmp_path / "alpaca.jsonl").write_text(json.dumps(alpaca) + "\n")
    turns = [{"role": "user", "content": "2 + 3?"}, {"role": "assistant", "content": "5"}]
    assert read_prompts(path) == [{"messages": turns}]
    assert read_prompts(alpaca_file)[0]["messages"][0] == {"role": "user", "content": "Add.\n2 and 3"}


def test_a_split_a_mapping_or_a_column_that_is_not_there_is_named_with_the_fix(tmp_path):
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": _renamed(RECORDS), "test": _renamed(RECORDS[:1])}).save_to_disk(saved)
    assert len(read_prompts(saved, fields=FIELDS)) == 1  # no validation split: test
    assert len(read_prompts(saved, fields=FIELDS, splits=("train",))) == 3
    first_two = read_prompts(jsonl_of(tmp_path, RECORDS[:2]))
    assert read_prompts(saved, fields=FIELDS, splits=("train",), limit=2) == first_two
    with pytest.raises(ValueError, match=r"has the splits \['train', 'test'\], and none of \['dev'\]. .*--split NAME"):
        read_prompts(saved, fields=FIELDS, splits=("dev",))
    with pytest.raises(ValueError, match=r"fields=\{'prompt': 'q'\} names the column\(s\) \['q'\], which it does not"):
        read_prompts(saved, fields={"prompt": "q"})
    with pytest.raises(ValueError, match=r"\{'text': 'q'\}: \['text'\] is not a format of prompts.*\{prompt\},"):
        check_prompt_fields({"text": "q"})
    with pytest.raises(ValueError, match=r"--fields \['q'\] must map field names to column names"):
        check_prompt_fields(["q"])
    assert check_prompt_fields({"prompt": "q"}) == {"prompt": "q"}  # a prompt alone: no reference
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps(RECORDS[0]) + "\n")
    with pytest.raises(ValueError, match=r"p.jsonl:1: each record needs a 'prompt' .* read under the fields"):
        read_prompts(jsonl, fields=FIELDS)  # its own columns are the standard ones
    (tmp_path / "splits").mkdir()
    for split in ("train", "test"):
        (tmp_path / "splits" / f"{split}.jsonl").write_text(json.dumps(RECORDS[0]) + "\n")
    with pytest.raises(ValueError, match=r"several splits .* would mix them. Name one split's files, e.g. --prompts="):
        read_prompts(tmp_path / "splits")
