"""What packing needs of every sample before any batch: its token count, and whether it is a ready row (a ``text``
block, which carries its ``position_ids``). Read from the Arrow columns where the samples stay in a table
(``TokenRows``), from the records' lengths for ``text`` blocks cut when read (``TextBlocks``), and through the views
and concatenations of them ``TextDataModule`` makes, so that a dataset of millions of rows is not decoded row by
row, twice, before training starts; read from the rows themselves for in-memory lists.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import ConcatDataset, Subset

from pl_lowprec.data.text_blocks import TextBlocks
from pl_lowprec.data.token_table import TokenRows

Row = dict[str, torch.Tensor]
KNOWS_ITS_ROWS = (TokenRows, TextBlocks)  # each has lengths() and ready(), read without decoding a row


def row_lengths(samples: Sequence[Row]) -> list[int]:
    """The token count of each sample, in index order."""
    return _per_row(samples, lambda rows: rows.lengths(), lambda row: len(row["input_ids"]))


def ready_rows(samples: Sequence[Row]) -> list[bool]:
    """Whether each sample, in index order, is a ready row that packing leaves as it is."""
    return _per_row(samples, lambda rows: rows.ready(), lambda row: "position_ids" in row)


def _per_row(samples: Sequence[Row], from_rows: Callable[[Any], list], from_row: Callable[[Row], Any]) -> list:
    """``from_rows`` of a ``TokenRows`` or ``TextBlocks``, through the ``Subset`` views and ``ConcatDataset`` joins
    over them; ``from_row`` of each row of anything else."""
    if isinstance(samples, KNOWS_ITS_ROWS):
        return from_rows(samples)
    if isinstance(samples, Subset):
        whole = _per_row(samples.dataset, from_rows, from_row)
        return [whole[i] for i in samples.indices]
    if isinstance(samples, ConcatDataset):
        return [value for part in samples.datasets for value in _per_row(part, from_rows, from_row)]
    return [from_row(row) for row in samples]
