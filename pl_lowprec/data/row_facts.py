"""What packing needs of every sample before any batch: its token count, and whether it is a ready row (a ``text``
block, which carries its ``position_ids``). Read from the Arrow columns where the samples stay in a table
(``TokenRows``, and the views and concatenations of them ``TextDataModule`` makes), so that a dataset of millions of
rows is not decoded row by row, twice, before training starts; read from the rows themselves for in-memory lists.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.utils.data import ConcatDataset, Subset

from pl_lowprec.data.token_table import TokenRows

Row = dict[str, torch.Tensor]


def row_lengths(samples: Sequence[Row]) -> list[int]:
    """The token count of each sample, in index order."""
    if isinstance(samples, TokenRows):
        return samples.lengths()
    if isinstance(samples, Subset):
        whole = row_lengths(samples.dataset)
        return [whole[i] for i in samples.indices]
    if isinstance(samples, ConcatDataset):
        return [n for part in samples.datasets for n in row_lengths(part)]
    return [len(s["input_ids"]) for s in samples]


def ready_rows(samples: Sequence[Row]) -> list[bool]:
    """Whether each sample, in index order, is a ready row that packing leaves as it is."""
    if isinstance(samples, TokenRows):
        return samples.ready()
    if isinstance(samples, Subset):
        whole = ready_rows(samples.dataset)
        return [whole[i] for i in samples.indices]
    if isinstance(samples, ConcatDataset):
        return [flag for part in samples.datasets for flag in ready_rows(part)]
    return ["position_ids" in s for s in samples]
