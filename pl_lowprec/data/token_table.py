"""Tokenized samples of a ``datasets.Dataset`` kept in a memory-mapped Arrow table, never in Python lists.

``Dataset.map`` runs the one record → tokens step (``TextDataModule._encode_records``, which ``.txt``/``.jsonl``
files go through too) batch by batch, in order, in this process, and writes each batch's rows (``input_ids``,
``labels``, int32) to an Arrow file in the temporary directory ``datasets`` deletes at exit: never beside the
user's files, never a stale cache. A run killed by SIGKILL (the OOM killer's) skips that deletion, so each table's
name holds its process id, and the next tokenization removes the tables of processes that are gone
(``remove_tables_of_dead_processes``). A batch gives its prompt/completion and chat samples, then its ``text``
records (``document`` rows, whose labels are their ``input_ids`` and are not stored). ``TokenRows`` reads the samples
back by index; ``TableDocuments`` reads slices of the records for the blocks ``text_blocks.TextBlocks`` cuts from
them, as it cuts a ``.jsonl`` file's records, so both give the same batches. Under DDP/FSDP a node tokenizes once,
on its first process, and its other processes read that table (``read_table``; ``TextDataModule``).
"""

from __future__ import annotations

import glob
import os
import tempfile
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from pl_lowprec._imports import import_datasets
from pl_lowprec.data.records import Sample

Row = dict[str, torch.Tensor]
MAP_BATCH_SIZE = 1000  # records a batch of Dataset.map: its Python lists hold this many at a time
# (row index, record) pairs of one batch -> its samples and its text records' token ids
EncodeRecords = Callable[[Iterable[tuple[int, dict[str, Any]]]], tuple[list[Sample], list[list[int]]]]
TABLE_PREFIX = "pl_lowprec-tokens-"  # then the process id, a random hex and ".arrow"


def batch_records(batch: dict[str, list]) -> Iterator[dict[str, Any]]:
    """The records (one dict each) of a batch of columns."""
    return (dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True))


def tokenize(dataset: Any, encode: EncodeRecords, description: str) -> Any:
    """``dataset``'s samples and ``text`` records as an Arrow table of ``input_ids``, ``labels`` and ``document``,
    memory-mapped."""
    datasets = import_datasets()

    def encode_batch(batch: dict[str, list], indices: list[int]) -> dict[str, list]:
        samples, documents = encode(zip(indices, batch_records(batch), strict=True))
        return {
            "input_ids": [s.input_ids for s in samples] + documents,
            "labels": [s.labels for s in samples] + [[] for _ in documents],
            "document": [False] * len(samples) + [True] * len(documents),
        }

    tokens = datasets.Features(
        {
            "input_ids": datasets.List(datasets.Value("int32")),
            "labels": datasets.List(datasets.Value("int32")),
            "document": datasets.Value("bool"),
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


def table_path(table: Any) -> str:
    """The Arrow file of a ``tokenize`` table."""
    return table.cache_files[0]["filename"]


def read_table(path: str) -> Any:
    """A ``tokenize`` table, memory-mapped from its Arrow file (another process's, on this node)."""
    return import_datasets().Dataset.from_file(path)


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


def _row_lengths(table: Any) -> torch.Tensor:
    """Each physical row's token count, from the ``input_ids`` column's offsets: no row is decoded."""
    chunks = table.data.column("input_ids").chunks
    counts = [torch.from_numpy(c.value_lengths().to_numpy(zero_copy_only=False).copy()) for c in chunks]
    return torch.cat(counts) if counts else torch.zeros(0, dtype=torch.int64)


class TokenRows(Dataset):
    """The samples of a ``tokenize`` table as tensors, read by index; its ``text`` records are ``documents()``."""

    def __init__(self, table: Any) -> None:
        document = torch.from_numpy(table.data.column("document").to_numpy(zero_copy_only=False))
        self.order = torch.nonzero(~document).squeeze(1)
        self.document_rows = torch.nonzero(document).squeeze(1).tolist()
        self.table = table.with_format("torch")

    def lengths(self) -> list[int]:
        """Each sample's token count, in index order, without decoding a row."""
        return _row_lengths(self.table)[self.order].tolist()

    def ready(self) -> list[bool]:
        """Whether each sample is a row that packing leaves as it is: none is (``text`` blocks are not samples)."""
        return [False] * len(self)

    def documents(self) -> TableDocuments:
        """The table's ``text`` records, in order."""
        return TableDocuments(self.table, self.document_rows)

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, index: int) -> Row:
        row = self.table[int(self.order[index])]
        return {"input_ids": row["input_ids"], "labels": row["labels"]}


class TableDocuments:
    """``text`` records of a ``tokenize`` table (``text_blocks.Documents``): a block reads only its own slice of
    each record from the Arrow column, so a long record is not decoded whole for every block of it."""

    def __init__(self, table: Any, rows: Sequence[int]) -> None:
        self.table = table
        self.rows = list(rows)

    def __len__(self) -> int:
        return len(self.rows)

    def lengths(self) -> list[int]:
        whole = _row_lengths(self.table)
        return whole[self.rows].tolist() if self.rows else []

    def tokens(self, index: int, start: int, stop: int) -> torch.Tensor:
        ids = self.table.data.column("input_ids")[self.rows[index]].values.slice(start, stop - start)
        return torch.from_numpy(ids.to_numpy(zero_copy_only=False).astype("int64"))

    def select(self, indices: Sequence[int]) -> TableDocuments:
        return TableDocuments(self.table, [self.rows[i] for i in indices])
