"""``val_fraction`` on ``text`` records holds out whole records, drawn before the text is cut into blocks (as
Hugging Face's run_clm splits before it groups): no record both trains and validates. A single record (one .txt
file) can only be split by its blocks, and the log says so."""

import json
import logging

import pytest
from loading_helpers import save_tokenizer

from pl_lowprec.data import TextDataModule

pytest.importorskip("transformers")

NAMES = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return save_tokenizer(tmp_path_factory.mktemp("tok"))


pytestmark = pytest.mark.usefixtures("datasets_cache_in_tmp")


def _document(name):
    return f"def {name}_doc(x):\n" + "".join(f"    {name} = {name} + {j}\n" for j in range(5))


def _names(data, rows):
    """The records each row holds some of, by the name that runs through each record."""
    texts = [data.tokenizer.decode(rows[i]["input_ids"]) for i in range(len(rows))]
    return [{name for name in NAMES if name in text} for text in texts]


def _setup(train_files, tokenizer_dir, **kwargs):
    data = TextDataModule(train_files=train_files, tokenizer=str(tokenizer_dir), seq_len=16, **kwargs)
    data.setup("fit")
    return data


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
@pytest.mark.parametrize("packing", [False, True])
def test_held_out_text_records_share_no_record_with_training(fmt, packing, tokenizer_dir, tmp_path, caplog):
    records = [{"text": _document(name)} for name in NAMES]
    if fmt == "jsonl":
        path = tmp_path / "docs.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    else:
        import datasets

        path = tmp_path / "docs.parquet"
        datasets.Dataset.from_list(records).to_parquet(str(path))
    with caplog.at_level(logging.INFO):
        data = _setup(path, tokenizer_dir, val_fraction=0.25, packing=packing)
    trained = set().union(*_names(data, data.train_set))
    validated = set().union(*_names(data, data.val_set))
    assert len(validated) == 2 and not trained & validated and trained | validated == set(NAMES)
    assert "held out 2 of 8 text records whole, drawn before the text is cut into seq_len blocks" in caplog.text
    again = _setup(path, tokenizer_dir, val_fraction=0.25, packing=packing)
    assert set().union(*_names(again, again.val_set)) == validated  # drawn with the seed


def test_a_single_text_record_holds_out_blocks_and_says_so(tokenizer_dir, tmp_path, caplog):
    path = tmp_path / "one.txt"
    path.write_text("".join(_document(name) for name in NAMES))
    with caplog.at_level(logging.INFO):
        data = _setup(path, tokenizer_dir, val_fraction=0.25)
    assert len(data.val_set) == round(0.25 * (len(data.train_set) + len(data.val_set))) > 0
    assert "the text is a single record, so validation holds out seq_len blocks of it" in caplog.text
