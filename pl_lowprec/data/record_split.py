"""Which rows validate when ``val_fraction`` holds out part of the training data: whole records, drawn before any
``text`` block is cut, wherever the text is more than one record.

``text`` records are joined and cut into ``seq_len`` blocks. A held-out block continues a record whose beginning
trains (or begins one whose end trains), so its validation loss partly measures text next to trained text. So, as
Hugging Face's ``run_clm`` splits its records before it groups them into blocks, the draw
(``validation_split.held_out_indices``) is over records: each prompt/completion or chat sample, and each ``text``
record whole; then each side cuts its own ``text`` records into blocks. A single ``text`` record (one ``.txt`` file)
cannot be split so: its blocks are drawn, as before. The log says which was done.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from pl_lowprec.data.row_views import joined, subset
from pl_lowprec.data.text_blocks import Documents
from pl_lowprec.data.validation_split import held_out_indices

Row = dict[str, torch.Tensor]
Blocks = Callable[[Documents], Sequence[Row]]  # text records -> their seq_len blocks


@dataclass
class SourceRows:
    """One source's rows before any block is cut: its prompt/completion and chat samples, and its ``text`` records."""

    samples: Sequence[Row]
    documents: Documents


def every_row(parts: Sequence[SourceRows], blocks: Blocks) -> Sequence[Row]:
    """Each source's samples, then the blocks of its ``text`` records, source after source."""
    return joined([joined([part.samples, blocks(part.documents)]) for part in parts])


def split_records(
    parts: Sequence[SourceRows], blocks: Blocks, val_fraction: float, seed: int
) -> tuple[Sequence[Row], Sequence[Row]]:
    """``(training, validation)`` rows: ``val_fraction`` of the records, each ``text`` record whole, where there is
    more than one ``text`` record; else of the samples and blocks, as ``held_out_indices`` draws them."""
    if val_fraction == 0:
        return every_row(parts, blocks), []
    documents = sum(len(part.documents) for part in parts)
    if documents < 2:
        rows = every_row(parts, blocks)
        training, validation = held_out_indices(len(rows), val_fraction, seed)
        if documents == 1 and validation:
            rank_zero_info(
                f"TextDataModule(val_fraction={val_fraction}): the text is a single record, so validation holds out"
                " seq_len blocks of it, which continue text that trains. Give it as several records (one per"
                " document, in a .jsonl file), or held-out text with val_files."
            )
        return subset(rows, training), subset(rows, validation)
    ends = _ends(parts)
    training, validation = held_out_indices(ends[-1], val_fraction, seed, unit="records")
    validation = sorted(validation)  # the held-out records are cut into blocks in their order
    held = sum(len(_documents(parts, ends, validation, i)) for i in range(len(parts)))
    samples = ends[-1] - documents
    beside = f" and {len(validation) - held} of {samples} other samples" if samples else ""
    rank_zero_info(
        f"TextDataModule(val_fraction={val_fraction}): held out {held} of {documents} text records whole{beside},"
        " drawn before the text is cut into seq_len blocks: no text record both trains and validates."
    )
    return _side(parts, ends, training, blocks), _side(parts, ends, validation, blocks)


def _ends(parts: Sequence[SourceRows]) -> list[int]:
    """Where each source's records (its samples, then its ``text`` records) end in the numbering the draw uses."""
    ends, end = [], 0
    for part in parts:
        end += len(part.samples) + len(part.documents)
        ends.append(end)
    return ends


def _records(ends: list[int], indices: list[int], source: int) -> list[int]:
    """Of the sorted ``indices``, those of ``source``'s records, numbered within it."""
    start = ends[source - 1] if source else 0
    return [i - start for i in indices[bisect.bisect_left(indices, start) : bisect.bisect_left(indices, ends[source])]]


def _documents(parts: Sequence[SourceRows], ends: list[int], indices: list[int], source: int) -> list[int]:
    """Of the sorted ``indices``, those of ``source``'s ``text`` records, numbered among them."""
    n = len(parts[source].samples)
    return [i - n for i in _records(ends, indices, source) if i >= n]


def _side(parts: Sequence[SourceRows], ends: list[int], indices: list[int], blocks: Blocks) -> Sequence[Row]:
    """The rows of the records at the sorted ``indices``: each source's samples, then its blocks."""
    rows = []
    for source, part in enumerate(parts):
        samples = [i for i in _records(ends, indices, source) if i < len(part.samples)]
        rows += [subset(part.samples, samples), blocks(part.documents.select(_documents(parts, ends, indices, source)))]
    return joined(rows)
