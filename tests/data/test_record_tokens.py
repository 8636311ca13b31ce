"""How ``text`` and prompt/completion records become ids: prompt + completion tokenized as one text, as the model
reads it in generation (TRL's SFTTrainer does the same), and each BOS and EOS once where the text carries its own."""

import logging

import pytest
from loading_helpers import save_tokenizer
from records_helpers import data_of_records
from sentencepiece_tokenizer import save_sentencepiece_tokenizer

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


def _said(caplog, what):
    return [r.getMessage() for r in caplog.records if what in r.getMessage()]


def test_sentencepiece_prompt_and_completion_are_the_ids_of_their_joined_text(tmp_path, sentencepiece_dir):
    data = data_of_records(tmp_path / "pc.jsonl", [{"prompt": p, "completion": c} for p, c in PAIRS], sentencepiece_dir)
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
        data = data_of_records(tmp_path / "space.jsonl", records, sentencepiece_dir)
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


def test_a_text_or_completion_ending_with_eos_gets_no_second_one(tmp_path, byte_level_dir, caplog):
    with caplog.at_level(logging.INFO):
        data = data_of_records(tmp_path / "text.jsonl", [{"text": "x = 1</s>"}, {"text": "y = 2</s>"}], byte_level_dir)
        pc = data_of_records(
            tmp_path / "pc.jsonl", [{"prompt": "Q: hi\nA:", "completion": " hello</s>"}], byte_level_dir
        )
    tokenizer = data.tokenizer
    (block,) = data.train_set
    assert block["input_ids"].tolist() == tokenizer("x = 1</s>")["input_ids"] + tokenizer("y = 2</s>")["input_ids"]
    (sample,) = pc.train_set
    assert sample["input_ids"].tolist() == tokenizer("Q: hi\nA: hello</s>")["input_ids"]
    assert tokenizer.decode([t for t in sample["labels"].tolist() if t != -100]) == " hello</s>"
    assert _said(caplog, "2 records whose text ends with the EOS '</s>', not appended a second time")
    assert _said(caplog, "1 record whose completion ends with the EOS '</s>', not appended a second time")


def test_a_text_starting_with_bos_gets_no_second_one(tmp_path, byte_level_dir, caplog):
    text = "<s><|user|>\nhi</s>\n<|assistant|>\nhello</s>\n"  # apply_chat_template(tokenize=False) of a chat
    with caplog.at_level(logging.INFO):
        data = data_of_records(tmp_path / "rendered.jsonl", [{"text": text}], byte_level_dir)
    tokenizer = data.tokenizer
    (block,) = data.train_set
    # the line ending after the last </s> is not trained, and no EOS is appended after it
    assert block["input_ids"].tolist() == tokenizer(text.removesuffix("\n"), add_special_tokens=False)["input_ids"]
    assert block["input_ids"].tolist().count(tokenizer.bos_token_id) == 1
    assert _said(caplog, "1 record whose text begins with the BOS '<s>', not added a second time")


def test_whitespace_after_a_final_eos_is_not_content_and_gets_no_second_eos(tmp_path, byte_level_dir, caplog):
    """A line ending after the last EOS (a JSONL writer's, a chat template's) trained EOS -> newline -> EOS."""
    texts = [{"text": "x = 1</s>\n"}, {"text": "a</s>\nb</s> \n\n"}, {"text": "y = 2\n"}]
    with caplog.at_level(logging.INFO):
        data = data_of_records(tmp_path / "text.jsonl", texts, byte_level_dir)
        pc = data_of_records(
            tmp_path / "pc.jsonl", [{"prompt": "Q: hi\nA:", "completion": " hello</s>\n"}], byte_level_dir
        )
    tokenizer, eos = data.tokenizer, data.tokenizer.eos_token_id
    (block,) = data.train_set
    expected = [  # an EOS inside the text keeps the newline after it; a text not ending in EOS keeps its own
        *tokenizer("x = 1</s>")["input_ids"],
        *tokenizer("a</s>\nb</s>")["input_ids"],
        *tokenizer("y = 2\n")["input_ids"],
        eos,
    ]
    assert block["input_ids"].tolist() == expected
    (sample,) = pc.train_set
    assert sample["input_ids"].tolist() == tokenizer("Q: hi\nA: hello</s>")["input_ids"]
    assert tokenizer.decode([t for t in sample["labels"].tolist() if t != -100]) == " hello</s>"
    assert _said(caplog, "2 records whose text has whitespace after its final EOS, not trained (not content)")
    assert _said(caplog, "1 record whose completion has whitespace after its final EOS, not trained (not content)")


def test_a_tokenizer_that_appends_eos_puts_none_after_the_prompt_and_one_at_the_end(tmp_path, sentencepiece_dir):
    from transformers import AutoTokenizer

    appends = tmp_path / "appends_eos"
    AutoTokenizer.from_pretrained(sentencepiece_dir, add_eos_token=True).save_pretrained(appends)
    pc = data_of_records(tmp_path / "pc.jsonl", [{"prompt": "Q: hi\nA:", "completion": " hello"}], str(appends))
    text = data_of_records(tmp_path / "text.jsonl", [{"text": "x = 1"}], str(appends))
    tokenizer, eos = pc.tokenizer, pc.tokenizer.eos_token_id
    assert tokenizer("hi")["input_ids"][-1] == eos  # the tokenizer appends EOS itself
    (sample,) = pc.train_set
    assert sample["input_ids"].tolist() == tokenizer("Q: hi\nA: hello")["input_ids"]
    assert sample["input_ids"].tolist().count(eos) == 1
    assert tokenizer.decode([t for t in sample["labels"].tolist() if t != -100]) == "hello</s>"
    (block,) = text.train_set
    assert block["input_ids"].tolist() == tokenizer("x = 1")["input_ids"]
    assert block["input_ids"].tolist().count(eos) == 1
    # its EOS after the line ending was kept beside the text's own: two
    (block,) = data_of_records(tmp_path / "eos_line.jsonl", [{"text": "x = 1</s>\n"}], str(appends)).train_set
    assert block["input_ids"].tolist() == tokenizer("x = 1")["input_ids"]
