"""Under DDP/FSDP a dataset is tokenized once per node, by its first process, and the other processes read that
table: the batches each rank trains on are those of each process tokenizing the records itself, and an error of
the first process's tokenization stops every rank with its message instead of leaving them waiting."""

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import warm_python
from loading_helpers import save_tokenizer

from pl_lowprec.data.token_table import TABLE_PREFIX

pytest.importorskip("datasets")

SCRIPT = Path(__file__).parents[1] / "_scripts" / "tokenize_once_ddp.py"
TIMEOUT_S = 300  # a rank left waiting for another is killed here: the test fails instead of hanging


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Path:
    return save_tokenizer(tmp_path_factory.mktemp("tokenizer"))


def _write(rows: list[dict], folder: Path) -> tuple[Path, Path]:
    """The records as a Parquet file (read by ``datasets``, tokenized into a table) and as ``.jsonl``."""
    import datasets

    parquet, jsonl = folder / "records.parquet", folder / "records.jsonl"
    datasets.Dataset.from_list(rows).to_parquet(str(parquet))
    jsonl.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return parquet, jsonl


def _run_ranks(tmp_path: Path, tokenizer: Path, records: Path, reference: Path, strategy: str) -> list[dict]:
    out = tmp_path / "out"
    out.mkdir()
    command = [sys.executable, str(SCRIPT), str(out), str(tokenizer), str(records), str(reference), strategy]
    env = {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "hf-cache")}  # load_dataset's copies: not ~/.cache
    run = warm_python.run(command, TIMEOUT_S, env=env, ranks=2)
    assert run.returncode == 0, run.stderr[-3000:]
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in (0, 1)]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_node_tokenizes_once_and_each_rank_trains_on_the_batches_it_had(tmp_path, tokenizer, strategy):
    rows = [{"prompt": f"def f{i}(x):\n    return", "completion": " x" + " + 1" * (i % 7)} for i in range(24)]
    parquet, jsonl = _write(rows, tmp_path)
    ranks = _run_ranks(tmp_path, tokenizer, parquet, jsonl, strategy)
    assert [r["outcome"] for r in ranks] == ["trained 3", "trained 3"]
    assert [r["tokenized"] for r in ranks] == [1, 0]  # the first process only
    (table,) = ranks[0]["tables"]
    assert ranks[1]["tables"] == [table]  # rank 1 reads rank 0's table
    assert Path(table).name.startswith(f"{TABLE_PREFIX}{ranks[0]['pid']}-")
    for rank in ranks:
        assert len(rank["batches"]) == 3
        for batch, expected in zip(rank["batches"], rank["expected"], strict=True):
            assert batch.keys() == expected.keys()
            for name, value in expected.items():
                assert torch.equal(batch[name], value), name
    first_ids = [r["batches"][0]["input_ids"] for r in ranks]
    assert not torch.equal(first_ids[0], first_ids[1])  # each rank its own shard


def test_an_error_of_the_first_process_stops_every_rank_with_its_message(tmp_path, tokenizer):
    """A tokenizer without a chat template refuses chat records while the first process tokenizes them: the other
    rank, which tokenizes nothing, raises the same one-paragraph error instead of waiting for a table."""
    no_template = tmp_path / "no_template"
    no_template.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (no_template / name).write_bytes((tokenizer / name).read_bytes())
    turns = [[{"role": "user", "content": "hi"}, {"role": "assistant", "content": f"hello {i}"}] for i in range(4)]
    parquet, jsonl = _write([{"messages": messages} for messages in turns], tmp_path)
    ranks = _run_ranks(tmp_path, no_template, parquet, jsonl, "ddp")
    outcomes = [r["outcome"] for r in ranks]
    assert outcomes[0] == outcomes[1], outcomes
    assert outcomes[0].startswith(f"stopped: {parquet}, row 0: 'messages' records are chat turns"), outcomes
    assert "has none. Use a chat model's tokenizer (--data.tokenizer)." in outcomes[0] and "\n" not in outcomes[0]
    assert [r["tokenized"] for r in ranks] == [1, 0] and ranks[1]["tables"] == []
