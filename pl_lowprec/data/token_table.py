"""Tokenized samples of a ``datasets.Dataset`` kept in a memory-mapped Arrow table, never in Python lists.

``Dataset.map`` runs the one record → tokens step (``TextDataModule._encode_records``, which ``.txt``/``.jsonl``
files go through too) batch by batch, in order, in this process, and writes each batch's samples (``input_ids``,
``labels``, int32) to an Arrow file in the temporary directory ``datasets`` deletes at exit: never beside the
user's files, never a stale cache. A run killed by SIGKILL (the OOM killer's) skips that deletion, so each table's
name holds its process id, and the next tokenization removes the tables of processes that are gone
(``remove_tables_of_dead_processes``). ``TokenRows`` reads the rows back by index. A batch gives its prompt/completion
and chat samples, then the ``text`` blocks it completed; ``TokenRows`` orders all samples before all blocks, the
order a ``.jsonl`` file gives, so both give the same batches.
"""

from __future__ import annotations

import glob
import os
import tempfile
import uuid
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils.data import Dataset

from pl_lowprec._imports import import_datasets
from pl_lowprec.data.packing import document_row
from pl_lowprec.data.records import Sample

Row = dict[str, torch.Tensor]
# (row index, record) pairs of one batch, and whether it is the last batch -> its samples
MAP_BATCH_SIZE = 1000  # records a batch of Dataset.map: its Python lists hold this many at a time
EncodeRecords = Callable[[Iterable[tuple[int, dict[str, Any]]], bool], list[Sample]]
TABLE_PREFIX = "pl_lowprec-tokens-"  # then the process id, a random hex and ".arrow"


def sample_row(input_ids: torch.Tensor, labels: torch.Tensor, text_block: bool, packing: bool, eos: int) -> Row:
    """A sample as the loaders take it; a ``text`` block under packing is a ready row, cut at each document's EOS."""
    if text_block and packing:
        return document_row(input_ids.tolist(), eos)
    return {"input_ids": input_ids, "labels": labels}


def batch_records(batch: dict[str, list]) -> Iterator[dict[str, Any]]:
    """The records (one dict each) of a batch of columns."""
    return (dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True))


def tokenize(dataset: Any, encode: EncodeRecords, description: str) -> Any:
    """``dataset``'s samples as an Arrow table of ``input_ids``, ``labels`` and ``text_block``, memory-mapped."""
    datasets = import_datasets()
    last = len(dataset) - 1

    def encode_batch(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        samples = encode(zip(indices, batch_records(batch), strict=True), indices[-1] == last)
        return {
            "input_ids": [s.input_ids for s in samples],
            "labels": [s.labels for s in samples],
            "text_block": [s.text_block for s in samples],
        }

    tokens = datasets.Features(
        {
            "input_ids": datasets.List(datasets.Value("int32")),
            "labels": datasets.List(datasets.Value("int32")),
            "text_block": datasets.Value("bool"),
        }
    )
    remove_tables_of_dead_processes()
    name = f"{TABLE_PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
    return dataset.map(
        encode_batch,
        batched=True,
        with_indices=True,
        remove_columns=dataset.column_names,
        features=tokens,
        load_from_cache_file=False,
        cache_file_name=os.path.join(datasets.fingerprint.get_temporary_cache_files_directory(), f"{name}.arrow"),
        new_fingerprint=name,  # the encoding step is not hashed: it is never read back from a cache
        batch_size=MAP_BATCH_SIZE,
        desc=f"Tokenizing {description}",
    )


def remove_tables_of_dead_processes(root: str | None = None) -> list[str]:
    """Delete the token tables that processes no longer running left in ``datasets``' temporary directories
    (``hf_datasets-*`` under ``root``, the system's temporary directory by default), and each directory left
    empty; the paths deleted. A table whose process is alive, or cannot be told, is kept."""
    pattern = os.path.join(root or tempfile.gettempdir(), "hf_datasets-*", f"{TABLE_PREFIX}*.arrow")
    removed = []
    for path in glob.glob(pattern):
        pid = os.path.basename(path).removeprefix(TABLE_PREFIX).partition("-")[0]
        if not pid.isdigit() or _alive(int(pid)):
            continue
        try:
            os.remove(path)
            removed.append(path)
            os.rmdir(os.path.dirname(path))  # only once empty: other files there are not this package's
        except OSError:
            pass
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class TokenRows(Dataset):
    """The rows of a ``tokenize`` table as tensors, read by index: the samples first, then the ``text`` blocks."""

    def __init__(self, table: Any, packing: bool, eos_token_id: int) -> None:
        self.blocks = torch.from_numpy(table.data.column("text_block").to_numpy(zero_copy_only=False))
        self.order = torch.cat([torch.nonzero(~self.blocks).squeeze(1), torch.nonzero(self.blocks).squeeze(1)])
        self.table = table.with_format("torch")
        self.packing = packing
        self.eos_token_id = eos_token_id

    def lengths(self) -> list[int]:
        """Each row's token count, in index order, from the ``input_ids`` column's offsets: no row is decoded."""
        chunks = self.table.data.column("input_ids").chunks
        counts = [torch.from_numpy(c.value_lengths().to_numpy(zero_copy_only=False).copy()) for c in chunks]
        whole = torch.cat(counts) if counts else torch.zeros(0, dtype=torch.int64)
        return whole[self.order].tolist()

    def ready(self) -> list[bool]:
        """Whether each row, in index order, is one packing leaves as it is (a ``text`` block: ``sample_row``)."""
        return (self.blocks[self.order] & self.packing).tolist()

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, index: int) -> Row:
        row = self.table[int(self.order[index])]
        return sample_row(row["input_ids"], row["labels"], bool(row["text_block"]), self.packing, self.eos_token_id)
