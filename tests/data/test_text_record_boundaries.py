"""Packed ``text`` records are cut where a record ends, never at an EOS inside one: a chat rendered to text with a
ChatML template holds its tokenizer's EOS (``<|im_end|>``) at every turn's end, and the answer must still attend to
its question. From a ``.jsonl`` file and from a Parquet file (an Arrow table), and in a resumed epoch."""

import itertools
import json
import warnings

import pytest
import torch
from loading_helpers import save_tokenizer

from pl_lowprec.data import TextDataModule
from pl_lowprec.data.records import encode_text

transformers = pytest.importorskip("transformers")

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
]


@pytest.fixture(scope="module")
def chatml_dir(tmp_path_factory):
    """The tests' BPE with ChatML's special tokens and template, whose EOS ends every turn (as Qwen2.5-Instruct's
    and SmolLM2-Instruct's does)."""
    directory = tmp_path_factory.mktemp("chatml")
    tokenizer = transformers.AutoTokenizer.from_pretrained(save_tokenizer(directory))
    tokenizer.add_special_tokens({"eos_token": "<|im_end|>", "additional_special_tokens": ["<|im_start|>"]})
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(directory)
    return directory


def _render(tokenizer, chats):
    """Chats rendered to ``text`` records (as ``apply_chat_template(tokenize=False)`` writes a TRL text field)."""
    return [{"text": tokenizer.apply_chat_template(chat, tokenize=False)} for chat in chats]


def _records(tokenizer_dir, n=6):
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    (rendered,) = _render(tokenizer, [CHAT])
    record = encode_text(tokenizer, rendered["text"])
    # three turns' <|im_end|>; the last ends the record: the template's line ending after it is not content, and no
    # EOS is appended after it
    assert record.count(tokenizer.eos_token_id) == 3 and record[-1] == tokenizer.eos_token_id
    return [rendered] * n, record


def _write(fmt, records, tmp_path):
    if fmt == "jsonl":
        path = tmp_path / "chats.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        return path
    datasets = pytest.importorskip("datasets")
    path = tmp_path / "chats.parquet"
    datasets.Dataset.from_list(records).to_parquet(str(path))
    return path


def _data(path, tokenizer_dir, seq_len, **kwargs):
    data = TextDataModule(
        train_files=path, tokenizer=str(tokenizer_dir), seq_len=seq_len, val_fraction=0, packing=True, **kwargs
    )
    data.setup("fit")
    return data


def _segments(values, positions):
    """A packed row's ``values`` (its ids or labels) cut where its ``positions`` restart at 0: its records."""
    starts = [i for i, p in enumerate(positions[: len(values)]) if p == 0] + [len(values)]
    return [values[a:b] for a, b in itertools.pairwise(starts)]


def _cut_only_between_records(ids, positions, record, pad):
    """Whether a packed row (its padding stripped) is cut only where a record ends: the segments inside it are
    whole records, the first ends one and the last begins one."""
    segments = _segments([t for t in ids if t != pad], positions)
    first, *inner, last = segments if len(segments) > 1 else [*segments, []]
    return record[-len(first) :] == first and all(s == record for s in inner) and record[: len(last)] == last


pytestmark = pytest.mark.usefixtures("datasets_cache_in_tmp")


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_chatml_record_is_one_segment_and_the_next_record_restarts(fmt, chatml_dir, tmp_path):
    records, record = _records(chatml_dir)
    n = len(record)
    data = _data(_write(fmt, records, tmp_path), chatml_dir, seq_len=2 * n + 5)
    row = data.train_set[0]  # a block: the first two records whole, then the third's beginning
    assert row["input_ids"].tolist() == record + record + record[:5]
    assert row["position_ids"].tolist() == [*range(n), *range(n), *range(5)]  # 0..n-1 across the turns
    targets = torch.ones(2 * n + 5, dtype=torch.bool)
    targets[[0, n, 2 * n]] = False  # only a record's first token is no target: it follows another record
    assert ((row["labels"] != -100) == targets).all()


def test_a_record_that_spans_blocks_is_cut_only_at_the_blocks_edge(chatml_dir, tmp_path):
    records, record = _records(chatml_dir, n=3)
    n = len(record)
    data = _data(_write("jsonl", records, tmp_path), chatml_dir, seq_len=n - 3)
    stream = record * 3
    rows = [data.train_set[i] for i in range(len(data.train_set))]
    assert torch.cat([r["input_ids"] for r in rows]).tolist() == stream[: sum(len(r["input_ids"]) for r in rows)]
    second = rows[1]["position_ids"].tolist()  # the first record's last 3 tokens, then the second record's
    assert second == [0, 1, 2, *range(n - 6)]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_a_resumed_epoch_gives_the_uninterrupted_runs_packed_text_batches(fmt, chatml_dir, tmp_path):
    records, record = _records(chatml_dir, n=12)
    path = _write(fmt, records, tmp_path)
    data = _data(path, chatml_dir, seq_len=2 * len(record) + 4, batch_size=2)  # 6 rows: 3 batches
    full = data.train_dataloader()
    full.sampler.set_epoch(1)
    batches = [{k: v.tolist() for k, v in b.items()} for b in full]
    resumed = _data(path, chatml_dir, seq_len=2 * len(record) + 4, batch_size=2).train_dataloader()
    resumed.load_state_dict({**full.state_dict(), "epoch": 1, "batches": 1})
    resumed.sampler.set_epoch(1)
    assert [{k: v.tolist() for k, v in b.items()} for b in resumed] == batches[1:]
    pad = data.tokenizer.pad_token_id
    rows = [row for b in batches for row in zip(b["input_ids"], b["position_ids"], strict=True)]
    assert len(rows) == 6 and all(_cut_only_between_records(*row, record, pad) for row in rows)


@pytest.mark.parametrize("packing", [False, True])
def test_join_text_false_keeps_each_text_record_one_whole_sample(tmp_path, chatml_dir, packing):
    """Text records are joined and cut into seq_len blocks (a pretraining corpus): a chat rendered to text was cut
    across two blocks, its answer trained without its question, with nothing said. The cut is now warned about,
    and join_text=False makes each record one sample (truncated at seq_len, packed whole), as TRL's SFTTrainer
    reads a text field."""
    chats = [
        [{"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": f"answer {i}"}]
        for i in range(12)
    ]
    records = _render(transformers.AutoTokenizer.from_pretrained(chatml_dir), chats)
    path = _write("jsonl", records, tmp_path)
    kwargs = {"train_files": path, "tokenizer": str(chatml_dir), "val_fraction": 0, "seq_len": 48}
    joined = TextDataModule(**kwargs, packing=packing)
    with pytest.warns(UserWarning, match=r"text records that would each fit in seq_len=48 tokens are cut across"):
        joined.setup("fit")
    whole = TextDataModule(**kwargs, packing=packing, join_text=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        whole.setup("fit")
    tokenizer = whole.tokenizer
    expected = sorted(tokenizer(r["text"].rstrip())["input_ids"] for r in records)
    samples = []
    for row in (whole.train_set[i] for i in range(len(whole.train_set))):
        ids, labels = row["input_ids"].tolist(), row["labels"].tolist()
        positions = row["position_ids"].tolist() if packing else [0]  # unpacked: the row is one sample
        for segment, targets in zip(_segments(ids, positions), _segments(labels, positions), strict=True):
            if set(targets) == {-100}:
                continue  # the padding that ends a packed row: a segment of its own
            assert targets[1:] == segment[1:]  # every token a target, none across records
            samples.append(segment)
    assert sorted(samples) == expected
