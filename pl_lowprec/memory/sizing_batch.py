"""The batch memory is sized for: the longest the training data makes, not the first one the loader draws.

Padded text batches are as long as their longest row, so with rows of mixed lengths the first batch drawn may be
several times shorter than the longest, and a peak predicted from it holds only until a long batch comes (an
out-of-memory error partway through the epoch). A data module that knows its rows says the longest with
``longest_train_row()`` (``TextDataModule``, ``StdlibTextDataModule``); the first batch is then stretched to it.
For any other data module the first batch is all there is, and the line that says the shape says so.
"""

from __future__ import annotations

from typing import Any

from pl_lowprec.memory.fake_step import batch_tensors
from pl_lowprec.memory.plan import resized


def batch_shape(batch: Any) -> tuple[int, int] | None:
    """``(rows, positions)`` of the batch's first 2-d tensor; ``None`` where it holds none."""
    return next((tuple(t.shape[:2]) for t in batch_tensors(batch) if t.dim() >= 2), None)


def sizing_batch(batch: Any, datamodule: Any) -> tuple[Any, str]:
    """``batch`` (the first training batch) at the longest row ``datamodule`` makes, and the shape in words."""
    shape = batch_shape(batch)
    longest = getattr(datamodule, "longest_train_row", None)
    if shape is None:
        return batch, "the first training batch"
    rows, length = shape
    if not callable(longest):
        source = "the loaders given to fit" if datamodule is None else type(datamodule).__name__
        return batch, (
            f"{rows} rows x {length} positions, the first training batch ({source} does not say its longest row,"
            " longest_train_row(): a longer batch needs more memory)"
        )
    most = int(longest())
    if most <= length:
        return batch, f"{rows} rows x {length} positions, the longest batch the training data makes"
    return resized(batch, rows, most), (
        f"{rows} rows x {most} positions, the longest batch the training data makes (the first drawn had {length}; a"
        " batch is as long as its longest row)"
    )
