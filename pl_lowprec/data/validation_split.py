"""Which samples validate: ``val_fraction`` of the training samples, or ``val_files``, with a warning where the
result is not what the arguments suggest.

A small corpus turns ``val_fraction=0.05`` into one held-out sample of two (half the training data), or none of
one; ``val_fraction`` beside ``val_files`` is not used; ``val_files`` naming the training file itself measures
memorisation, not generalisation. Each is legal, and each is said once, at setup, instead of showing later as
a strange validation loss.
"""

from __future__ import annotations

import filecmp
from pathlib import Path

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from pl_lowprec.data.sources import Source

DEFAULT_VAL_FRACTION = 0.05
OVERSHOOT = 2  # a held-out share this many times val_fraction, or more, is said


def held_out_indices(
    n_samples: int, val_fraction: float, seed: int, unit: str = "samples"
) -> tuple[list[int], list[int]]:
    """``(training, validation)`` indices of ``n_samples`` samples (or records, ``unit``): ``val_fraction`` of them
    drawn with ``seed``, at least one where there are two or more; the training indices keep the file order."""
    order = torch.randperm(n_samples, generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = round(n_samples * val_fraction)
    n_val = max(n_val, 1) if val_fraction > 0 and n_samples > 1 else n_val
    warn_held_out_share(n_samples, n_val, val_fraction, unit)
    return sorted(order[n_val:]), order[:n_val]


def warn_held_out_share(n_samples: int, n_val: int, val_fraction: float, unit: str = "samples") -> None:
    """Say where rounding to whole samples (or records, ``unit``) makes the held-out share far from
    ``val_fraction``."""
    if val_fraction == 0:
        return
    one = unit.removesuffix("s")
    if n_val == 0:
        rank_zero_warn(
            f"TextDataModule(val_fraction={val_fraction}) holds out nothing: the training files make {n_samples}"
            f" {one}, so there is no validation. Give more data, or validation data with val_files."
        )
    elif n_val >= OVERSHOOT * val_fraction * n_samples:
        blocks = " (text files make one sample per seq_len tokens)" if unit == "samples" else ""
        rank_zero_warn(
            f"TextDataModule(val_fraction={val_fraction}) holds out {n_val} of {n_samples} {unit}"
            f" ({n_val / n_samples:.0%} of the training data), since at least one {one} validates. Give more data"
            f"{blocks}, validation data with val_files, or val_fraction=0 for no validation."
        )


def warn_unused_val_fraction(val_fraction: float) -> None:
    """``val_fraction`` other than its default beside ``val_files``: the files decide, the fraction is not used."""
    if val_fraction not in (0, DEFAULT_VAL_FRACTION):  # 0 beside val_files: nothing is held out, as asked
        rank_zero_warn(
            f"TextDataModule(val_fraction={val_fraction}) is not used: val_files gives the validation samples, and"
            " every training sample trains. Leave val_fraction out, or val_files out to hold out that share."
        )


def warn_validation_on_training_files(train_sources: list[Source], val_sources: list[Source]) -> None:
    """Say where a validation file is a training file, or a byte-for-byte copy of one: its loss then measures
    memorisation. Dataset directories are left alone, as each side may read its own split."""
    train_files = [s.path for s in train_sources if s.kind in ("native", "file") and s.path is not None]
    for source in val_sources:
        if source.kind not in ("native", "file") or source.path is None:
            continue
        same = next((path for path in train_files if _same_file(source.path, path)), None)
        if same is not None:
            relation = "is" if source.path.resolve() == same.resolve() else "is a copy of"
            rank_zero_warn(
                f"TextDataModule: val_files {source.path} {relation} the training file {same}, so the validation"
                " loss is measured on samples the model trains on. Give held-out data, or leave val_files out to"
                " hold out val_fraction of the training samples."
            )


def _same_file(a: Path, b: Path) -> bool:
    if a.resolve() == b.resolve():
        return True
    return a.is_file() and b.is_file() and a.stat().st_size == b.stat().st_size and filecmp.cmp(a, b, shallow=False)
