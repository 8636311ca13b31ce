"""Views of sample rows, never copies of them: the rows at some indices, and several sources' rows one after
another. A list stays a list; rows in an Arrow table (``TokenRows``) or cut when read (``TextBlocks``) stay where
they are, behind one ``Subset`` or ``ConcatDataset``, not a chain of them, so that ``row_facts`` reads their facts
from the columns."""

from __future__ import annotations

import bisect
from collections.abc import Sequence

import torch
from torch.utils.data import ConcatDataset, Subset

Row = dict[str, torch.Tensor]


def subset(samples: Sequence[Row], indices: list[int]) -> Sequence[Row]:
    """The samples at ``indices``: a list of a list, a view of other rows (of one part, where a join's indices all
    fall in one)."""
    if isinstance(samples, list):
        return [samples[i] for i in indices]
    if isinstance(samples, Subset):  # one view, not a chain of them
        return subset(samples.dataset, [samples.indices[i] for i in indices])
    if isinstance(samples, ConcatDataset) and indices:
        ends = samples.cumulative_sizes
        part = bisect.bisect_right(ends, indices[0])
        start = ends[part - 1] if part else 0
        if all(start <= i < ends[part] for i in indices):
            return subset(samples.datasets[part], [i - start for i in indices])
    return Subset(samples, indices)


def joined(parts: Sequence[Sequence[Row]]) -> Sequence[Row]:
    """``parts`` one after another: a list where all are lists, else the one part with rows, or a join."""
    if all(isinstance(part, list) for part in parts):
        return [row for part in parts for row in part]
    nonempty = [part for part in parts if len(part) > 0]
    if len(nonempty) == 1:
        return nonempty[0]
    return ConcatDataset(nonempty) if nonempty else []
