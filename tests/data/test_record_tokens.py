"""How prompt/completion records become ids: prompt + completion tokenized as one text, as the model reads it in
generation (TRL's SFTTrainer does the same)."""

import json

import pytest
from loading_helpers import save_tokenizer
from sentencepiece_tokenizer import save_sentencepiece_tokenizer

from pl_lowprec.data import TextDataModule

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

# Tokenized on its own, the completion started with a space of the SentencePiece tokenizer's ('A:' + '4': 'A: 4').
PAIRS = [("Q: 2+2?\nA:", "4"), ("Q: 2+2?\nA:", " 4"), ("Translate: cat\n", "chat"), ("def f(x):\n", "    return x")]


@pytest.fixture(scope="module")
def sentencepiece_dir(tmp_path_factory):
    return str(save_sentencepiece_tokenizer(tmp_path_factory.mktemp("sentencepiece")))


@pytest.fixture(scope="module")
def byte_level_dir(tmp_path_factory):
    return str(save_tokenizer(tmp_path_factory.mktemp("byte_level")))


def _setup(path, records, tokenizer, **kwargs):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    data = TextDataModule(train_files=path, tokenizer=tokenizer, val_fraction=0, **kwargs)
    data.setup("fit")
    return data


def _said(caplog, what):
    return [r.getMessage() for r in caplog.records if what in r.getMessage()]


def test_sentencepiece_prompt_and_completion_are_the_ids_of_their_joined_text(tmp_path, sentencepiece_dir):
    data = _setup(tmp_path / "pc.jsonl", [{"prompt": p, "completion": c} for p, c in PAIRS], sentencepiece_dir)
    tokenizer = data.tokenizer
    for (prompt, completion), sample in zip(PAIRS, data.train_set, strict=True):
        ids = tokenizer(prompt + completion)["input_ids"] + [tokenizer.eos_token_id]
        before = len(tokenizer(prompt)["input_ids"])
        assert ids[:before] == tokenizer(prompt)["input_ids"]  # no token holds the prompt's end and more
        assert sample["input_ids"].tolist() == ids
        assert sample["labels"].tolist() == [-100] * before + ids[before:]
        assert tokenizer.decode(sample["input_ids"], skip_special_tokens=True) == prompt + completion


def test_a_prompt_ending_inside_a_token_trains_that_token_and_is_said_once_per_file(tmp_path, sentencepiece_dir):
    records = [{"prompt": "def f(x): ", "completion": "return x"}] * 3  # '▁return' holds the prompt's space
    with pytest.warns(UserWarning, match=r"3 records' prompts end inside a token") as said:
        data = _setup(tmp_path / "space.jsonl", records, sentencepiece_dir)
    assert len([w for w in said if "inside a token" in str(w.message)]) == 1
    assert "'def f(x): ' ends inside the token ' return'" in str(said[0].message)
    tokenizer = data.tokenizer
    ids = tokenizer("def f(x): return x")["input_ids"] + [tokenizer.eos_token_id]
    sample = data.train_set[0]
    assert sample["input_ids"].tolist() == ids
    assert tokenizer.convert_ids_to_tokens([t for t in sample["labels"].tolist() if t != -100]) == [
        "\u2581return",
        *tokenizer.convert_ids_to_tokens(ids[-3:]),
    ]
