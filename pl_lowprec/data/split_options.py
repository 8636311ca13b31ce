"""``train_split`` and ``val_split`` checked against what the sources hold, before any step.

A split is chosen from a ``DatasetDict`` (a hub id, a ``save_to_disk`` directory of one, or one passed in Python).
A file, or a single ``Dataset``, has one split, ``train``, as ``datasets.load_dataset(builder, data_files=FILE)``
reads it; ``load_dataset(..., split="test")`` on it fails with "Unknown split". Here such a split was ignored
without a word, and the run trained (or validated) on the whole file. So a split other than ``train`` named for
sources none of which has splits is refused, with what is allowed and the fix.

``val_split`` without ``val_files`` reads that split of ``train_files``' dataset dicts, as TRL's scripts read
``dataset_test_split`` of the one ``dataset_name``; without a dataset dict among them it is refused.
"""

from __future__ import annotations

from pl_lowprec._imports import import_datasets
from pl_lowprec.data.sources import Source

ONE_SPLIT = "train"  # the one split of a file or a single Dataset, as ``datasets`` names it
SPLIT_SOURCES = (
    "a dataset dict (a hub id, a save_to_disk directory of a DatasetDict, or a DatasetDict passed in Python)"
)


def has_splits(source: Source) -> bool:
    """Whether ``source`` is a ``DatasetDict``: a hub dataset (``load_dataset(id)`` gives one), a directory saved
    from one (its ``dataset_dict.json``), or one passed in Python."""
    if source.kind == "hub":
        return True
    if source.kind == "saved":
        return source.path is not None and (source.path / "dataset_dict.json").is_file()
    if source.kind == "object":
        return isinstance(source.dataset, import_datasets().DatasetDict)
    return False


def check_split(option: str, split: str | None, sources: list[Source], argument: str) -> None:
    """A ``split`` other than ``train`` named in ``option`` for ``sources`` (those of ``argument``) none of which
    has splits: refused, naming them. ``option`` a command's (``--split``) or the data module's."""
    if split is None or split == ONE_SPLIT or any(has_splits(source) for source in sources):
        return
    named = shown_labels(sources)
    files = argument == "train_files"
    fix = f"leave {option} out (a file is read whole), or name the {split!r} split's own files as {argument}" + (
        " (and the held-out ones as val_files)" if files else ""
    )
    given = f"{option} {split!r}" if option.startswith("--") else f"TextDataModule({option}={split!r})"
    raise ValueError(
        f"{given}: {argument} ({named}) has no splits to choose from: a file, or a"
        f" single Dataset, is one split, {ONE_SPLIT!r}, as datasets.load_dataset reads it, and {option} would be"
        f" ignored, reading all of it. {option} chooses a split of {SPLIT_SOURCES}. Fix: {fix}."
    )


def validation_sources(val_split: str, train_sources: list[Source]) -> list[Source]:
    """The sources ``val_split`` is read from when ``val_files`` is not given: ``train_files``' dataset dicts (TRL's
    ``dataset_test_split``); refused where there is none, since the split would be ignored."""
    with_splits = [source for source in train_sources if has_splits(source)]
    if with_splits:
        return with_splits
    named = shown_labels(train_sources)
    raise ValueError(
        f"TextDataModule(val_split={val_split!r}) without val_files reads that split of train_files' dataset dicts,"
        f" and train_files ({named}) has none: a file, or a single Dataset, has no {val_split!r} split, and"
        " val_split would be ignored, holding out val_fraction of the training records instead. val_split chooses"
        f" a split of {SPLIT_SOURCES}. Fix: give the validation records as val_files (--data.val_files FILE), or"
        " leave val_split out to hold out val_fraction of the training records."
    )


def shown_labels(sources: list[Source]) -> str:
    """The first three sources' labels, then ``...`` where there are more: what a refusal names."""
    return ", ".join(source.label for source in sources[:3]) + (" ..." if len(sources) > 3 else "")
