"""The batch memory is sized for: the longest the training data makes, not the first one the loader draws.

Padded text batches are as long as their longest row, so with rows of mixed lengths the first batch drawn may be
several times shorter than the longest, and a peak predicted from it holds only until a long batch comes (an
out-of-memory error partway through the epoch). A data module that knows its rows says the longest with
``longest_train_row()`` (``TextDataModule``, ``StdlibTextDataModule``); the first batch is then stretched to it.
For any other data module the first batch is all there is, and the line that says the shape says so.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.model_helpers import is_overridden

from pl_lowprec.memory.fake_step import batch_tensors
from pl_lowprec.memory.plan import resized


def first_rows(batch: Any) -> Any:
    """The batch's first tensor of two or more dimensions; ``None`` where it holds none."""
    return next((t for t in batch_tensors(batch) if t.dim() >= 2), None)


def batch_shape(batch: Any) -> tuple[int, int] | None:
    """``(rows, positions)`` of the batch's first 2-d tensor; ``None`` where it holds none."""
    first = first_rows(batch)
    return None if first is None else tuple(first.shape[:2])


def holds_token_rows(batch: Any) -> bool:
    """Whether the batch's first tensor of two or more dimensions is integer rows of positions (token ids), the
    only kind a longer batch can come of; features (``x[4, 16]`` floats) or images have no positions."""
    first = first_rows(batch)
    return first is not None and first.dim() == 2 and not (first.is_floating_point() or first.is_complex())


def tensor_shapes(batch: Any) -> str:
    """The batch's tensors as ``4x16 float32, 4 int64``: how a batch without token rows is said."""
    return ", ".join(
        f"{'x'.join(map(str, t.shape)) or 'scalar'} {str(t.dtype).removeprefix('torch.')}" for t in batch_tensors(batch)
    )


def first_config_batch(model: Any, datamodule: Any, command: str) -> tuple[Any, Any]:
    """The first training batch of a config that ``command`` (estimate, plan) reads without a Trainer, and what
    it came from: the data module, or else the module's own ``train_dataloader``, as ``fit`` takes it."""
    if datamodule is not None:
        datamodule.setup("fit")
        return next(iter(datamodule.train_dataloader())), datamodule
    if is_overridden("train_dataloader", model):
        try:
            return next(iter(model.train_dataloader())), model
        except Exception as err:  # e.g. a loader that reads self.trainer, which is not built here
            raise ValueError(
                f"The config names no data module, and {type(model).__name__}.train_dataloader() failed without a"
                f" Trainer ({type(err).__name__}: {err}): the {command} takes the shape of one training batch from it."
                " Give the data as a data module (data: class_path ...), or a train_dataloader that needs no Trainer."
            ) from err
    raise ValueError(
        f"The config names no data module (data: class_path ...) and {type(model).__name__} has no"
        f" train_dataloader: the {command} takes the shape of one training batch from one of them. Add the data"
        " section that `pl-lowprec fit` runs with."
    )


def sizing_batch(batch: Any, datamodule: Any) -> tuple[Any, str]:
    """``batch`` (the first training batch) at the longest row ``datamodule`` makes, and the shape in words."""
    shape = batch_shape(batch)
    longest = getattr(datamodule, "longest_train_row", None)
    if shape is None:
        return batch, "the first training batch"
    if not holds_token_rows(batch):
        return batch, f"the first training batch ({tensor_shapes(batch)})"
    rows, length = shape
    if not callable(longest):
        source = "the loaders given to fit do" if datamodule is None else f"{type(datamodule).__name__} does"
        return batch, (
            f"{rows} rows x {length} positions, the first training batch ({source} not say the longest row,"
            " longest_train_row(): a longer batch needs more memory)"
        )
    most = int(longest())
    if most <= length:
        return batch, f"{rows} rows x {length} positions, the longest batch the training data makes"
    return resized(batch, rows, most), (
        f"{rows} rows x {most} positions, the longest batch the training data makes (the first drawn had {length}; a"
        " batch is as long as its longest row)"
    )
