"""Packing: best-fit-decreasing rows, positions and labels cut per sample, per-epoch rows, ranks, refusals."""

import json
import logging

import pytest
import torch
from loading_helpers import save_tokenizer

from pl_lowprec.data import TextDataModule
from pl_lowprec.data.collate import PackedCollate
from pl_lowprec.data.packing import PackedRows, best_fit_decreasing, document_row, pack_row, padding_fraction
from pl_lowprec.data.resumable import ResumableSampler

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    return save_tokenizer(tmp_path_factory.mktemp("tok"))


def _sample(n: int, prompt: int = 0, start: int = 0) -> dict[str, torch.Tensor]:
    ids = torch.arange(start, start + n)
    labels = ids.clone()
    labels[:prompt] = -100
    return {"input_ids": ids, "labels": labels}


def test_best_fit_decreasing_puts_each_length_in_the_fullest_row_it_fits():
    bins = best_fit_decreasing([6, 5, 4, 3, 2, 2], 8, torch.Generator().manual_seed(0))
    assert [[[6, 5, 4, 3, 2, 2][i] for i in b] for b in bins] == [[6, 2], [5, 3], [4, 2]]
    assert sorted(i for b in bins for i in b) == list(range(6))


def test_pack_row_restarts_positions_and_never_targets_the_next_sample():
    row = pack_row([_sample(3, start=10), _sample(4, prompt=2, start=20)])
    assert row["input_ids"].tolist() == [10, 11, 12, 20, 21, 22, 23]
    assert row["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3]
    assert row["labels"].tolist() == [-100, 11, 12, -100, -100, 22, 23]  # 20 is never the target of 12


def test_text_documents_restart_positions_where_each_starts():
    row = document_row([5, 6, 0, 7, 8, 9, 0, 4], document_starts=[3, 7])
    assert row["position_ids"].tolist() == [0, 1, 2, 0, 1, 2, 3, 0]
    assert row["labels"].tolist() == [-100, 6, 0, -100, 8, 9, 0, -100]


def test_rows_change_with_the_epoch_but_not_their_number_and_every_sample_is_used_once():
    samples = [_sample(n, start=100 * i) for i, n in enumerate([3, 3, 3, 3, 2, 2, 5, 5, 1, 4])]
    rows = PackedRows(samples, seq_len=8, seed=0)
    n = len(rows)

    def epoch(e):
        return [tuple(rows[e * n + r]["input_ids"].tolist()) for r in range(n)]

    for e in range(3):
        tokens = sorted(t for row in epoch(e) for t in row)
        assert tokens == sorted(t for s in samples for t in s["input_ids"].tolist())
        assert all(len(row) <= 8 for row in epoch(e))
    assert epoch(0) == epoch(0) and epoch(0) != epoch(1)
    assert epoch(1) == [tuple(PackedRows(samples, 8, 0)[n + r]["input_ids"].tolist()) for r in range(n)]


def test_ranks_see_disjoint_packed_rows():
    samples = [_sample(n) for n in [7, 1, 6, 2, 5, 3, 4, 4, 8, 3, 2]]
    rows = PackedRows(samples, seq_len=8, seed=3)
    n = len(rows)
    assert n % 2 == 0  # an odd count would make DistributedSampler repeat one row to even out the ranks
    for epoch in (0, 1):
        seen = []
        for rank in (0, 1):
            sampler = ResumableSampler(rows, num_replicas=2, rank=rank, seed=3, epoch_indexed=True)
            sampler.set_epoch(epoch)
            seen.append(set(sampler))
        assert not seen[0] & seen[1]
        assert seen[0] | seen[1] == set(range(epoch * n, (epoch + 1) * n))


def test_packed_batches_have_position_ids_and_no_attention_mask():
    rows = [pack_row([_sample(3), _sample(2)]), pack_row([_sample(2)])]
    batch = PackedCollate(pad_token_id=9)(rows)
    assert set(batch) == {"input_ids", "labels", "position_ids"}
    assert batch["input_ids"][1].tolist() == [0, 1, 9, 9, 9]
    assert batch["position_ids"][1].tolist() == [0, 1, 0, 1, 2]  # the padding is a segment of its own
    assert batch["labels"][1].tolist() == [-100, 1, -100, -100, -100]


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _chat(i: int) -> dict:
    turns = [("user", "def f(x):" + " x" * (i % 13)), ("assistant", " return" + " y" * (i % 5))]
    return {"messages": [{"role": role, "content": text} for role, text in turns]}


@pytest.mark.parametrize("kind", ["prompt_completion", "messages"])
def test_datamodule_packs_samples_and_logs_the_padding_it_saves(tmp_path, tokenizer_dir, caplog, kind):
    records = [
        {"prompt": "def f(x):" + " x" * (i % 13), "completion": " return" + " y" * (i % 5)}
        if kind == "prompt_completion"
        else _chat(i)
        for i in range(30)
    ]
    path = _jsonl(tmp_path / "pc.jsonl", records)
    kwargs = {"train_files": path, "tokenizer": str(tokenizer_dir), "seq_len": 64, "batch_size": 4, "val_fraction": 0}
    plain = TextDataModule(**kwargs)
    plain.setup("fit")
    with caplog.at_level(logging.INFO):
        packed = TextDataModule(**kwargs, packing=True)
        packed.setup("fit")
    line = next(r.getMessage() for r in caplog.records if "packing=True" in r.getMessage())
    assert f"30 training samples in {len(packed.train_set)} rows of seq_len=64" in line
    assert len(packed.train_set) < 30
    targets = sum(int((s["labels"][1:] != -100).sum()) for s in plain.train_set)
    batches = list(packed.train_dataloader())
    assert sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches) == targets  # same target tokens
    assert all("attention_mask" not in b and b["input_ids"].shape[1] <= 64 for b in batches)


def test_text_records_under_packing_cut_attention_at_each_document(tmp_path, tokenizer_dir):
    records = [{"text": "import os" + " x" * i} for i in range(12)]
    data = TextDataModule(
        _jsonl(tmp_path / "t.jsonl", records), str(tokenizer_dir), seq_len=32, val_fraction=0, packing=True
    )
    data.setup("fit")
    eos = data.tokenizer.eos_token_id
    row = data.train_set[0]
    after_eos = torch.nonzero(row["input_ids"][:-1] == eos).squeeze(1) + 1
    assert len(after_eos) > 0 and (row["position_ids"][after_eos] == 0).all()
    assert (row["labels"][after_eos] == -100).all()


def test_a_sample_longer_than_seq_len_follows_the_truncation_rule_under_packing(tmp_path, tokenizer_dir):
    records = [{"prompt": "p", "completion": " word" * 60}] + [{"prompt": "p", "completion": " a"}] * 3
    path = _jsonl(tmp_path / "long.jsonl", records)
    with pytest.raises(ValueError, match=r"seq_len=16 cuts 1 samples.*--data.seq_len"):
        TextDataModule(path, str(tokenizer_dir), seq_len=16, val_fraction=0, packing=True).setup("fit")
    data = TextDataModule(path, str(tokenizer_dir), seq_len=16, val_fraction=0, packing=True, max_truncated_fraction=1)
    data.setup("fit")
    assert max(data.train_set.row_lengths()) == 16


def test_a_module_that_does_not_declare_packed_batches_is_refused(tmp_path, tokenizer_dir):
    import lightning.pytorch as pl

    from pl_lowprec.demo import TinyLlama

    path = _jsonl(tmp_path / "pc.jsonl", [{"prompt": "p", "completion": " c"}] * 4)
    data = TextDataModule(path, str(tokenizer_dir), val_fraction=0, packing=True)
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False, max_steps=1)
    trainer.strategy.connect(TinyLlama(hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2, max_len=16))
    data.trainer = trainer
    refused = r"TinyLlama does not declare.*accepts_packed_batches = True.*use_cache=False.*packing=False"
    with pytest.raises(ValueError, match=refused):
        data.setup("fit")
    assert data.train_set is None  # refused before any data is read


def test_the_padding_without_packing_is_that_of_the_samples_in_their_own_order(tmp_path, tokenizer_dir, caplog):
    """Two files: each gives its samples, then its text blocks, so packing's split (samples, then every block)
    is another order, whose padding differs."""
    files = []
    for name in ("a", "b"):
        texts = [{"text": "import os\n" * (3 + i % 11)} for i in range(12)]
        samples = [{"prompt": "def f(x):" + " x" * (i % 13), "completion": " y"} for i in range(20)]
        files.append(_jsonl(tmp_path / f"{name}.jsonl", texts + samples))
    kwargs = {"train_files": files, "tokenizer": str(tokenizer_dir), "seq_len": 64, "batch_size": 4, "val_fraction": 0}
    plain = TextDataModule(**kwargs)
    plain.setup("fit")
    with caplog.at_level(logging.INFO):
        TextDataModule(**kwargs, packing=True).setup("fit")
    line = next(r.getMessage() for r in caplog.records if "packing=True" in r.getMessage())
    unpacked = padding_fraction([len(s["input_ids"]) for s in plain.train_set], 4, plain.seed)
    assert f"padding {unpacked:.1%} of the batch tokens without packing" in line, line
