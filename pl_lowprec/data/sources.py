"""What ``train_files`` and ``val_files`` name, resolved when the data module is built, before any step.

A source of records is one of:
- a ``.txt`` or ``.jsonl`` file, read line by line here (no extra needed);
- a ``.parquet``, ``.csv``, ``.json`` (an array or JSON lines) or ``.arrow`` file, a directory written by
  ``save_to_disk``, a hub dataset id (``org/name``, where there is network), or a ``datasets.Dataset`` /
  ``DatasetDict`` passed in Python: read through Hugging Face ``datasets`` (``pl_lowprec.data.dataset_files``).

Directories are walked (a ``save_to_disk`` directory is one source) and glob patterns expanded. Files of a data
format this module does not read are refused with the list; other files (a README) are listed in the log. A
directory holding the files of several splits (``train-*.parquet`` beside ``test-*.parquet``, as hub repositories
lay them out) is refused: reading it all would train on the held-out split.
"""

from __future__ import annotations

import glob
import os
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from pl_lowprec._did_you_mean import closest
from pl_lowprec._imports import import_datasets

NATIVE_SUFFIXES = (".txt", ".jsonl")
DATASETS_SUFFIXES = (".parquet", ".csv", ".json", ".arrow")
READ_SUFFIXES = NATIVE_SUFFIXES + DATASETS_SUFFIXES
# Data files a directory may hold that this module does not read: refused rather than skipped in silence.
UNREAD_DATA_SUFFIXES = {".tsv", ".feather", ".gz", ".bz2", ".xz", ".zst", ".zip", ".tar"}
SAVED_DATASET_MARKERS = ("dataset_dict.json", "state.json")  # written by DatasetDict / Dataset.save_to_disk
# A dataset's metadata, not records (hub repositories and save_to_disk write them): listed, not read.
METADATA_FILES = {"dataset_info.json", "dataset_infos.json", "dataset_dict.json", "state.json"}
SPLIT_NAME = re.compile(r"(train|validation|valid|val|test|dev|eval)(-\d+-of-\d+)?", re.IGNORECASE)
HELD_OUT_ORDER = ["validation", "valid", "val", "dev", "eval", "test"]  # val_files: a validation split before test
HUB_ID = re.compile(r"[\w][\w.-]*/[\w][\w.-]*")
READ = ", ".join(READ_SUFFIXES)


@dataclass(frozen=True)
class Source:
    """One place records come from; ``label`` names it in reports and errors."""

    label: str
    kind: Literal["native", "file", "saved", "hub", "object"]
    path: Path | None = None
    hub_id: str | None = None
    dataset: Any = field(default=None, compare=False)


def is_dataset_object(value: Any) -> bool:
    """Whether ``value`` is not a path (nor a list of them): a ``datasets`` object, or a mistake."""
    items = value if isinstance(value, (list, tuple)) else [value]
    return not all(isinstance(item, (str, Path)) for item in items)


def describe_objects(value: Any) -> str | list[str]:
    """What the checkpoint's hyper-parameters keep of ``datasets`` objects: a description, never the data."""
    if isinstance(value, (list, tuple)):
        return [describe_objects(item) for item in value]
    if isinstance(value, (str, Path)):
        return str(value)
    rows = getattr(value, "num_rows", None)
    return f"{type(value).__name__}(num_rows={rows}, fingerprint={getattr(value, '_fingerprint', None)})"


def resolve_sources(files: Any, argument: str) -> list[Source]:
    """The sources ``files`` names; ``ValueError`` (or ``TypeError``) for anything that is not one."""
    named = list(files) if isinstance(files, (list, tuple)) else [files]
    if not named:
        raise ValueError(f"{argument} is empty. Give files, directories or a dataset.")
    found: list[Source] = []
    for item in named:
        if isinstance(item, (str, Path)):
            found += path_sources(item, argument)
        else:
            found.append(object_source(item, argument))
    return found


def object_source(value: Any, argument: str) -> Source:
    """A ``datasets.Dataset`` or ``DatasetDict`` passed in Python."""
    datasets = import_datasets()
    if isinstance(value, (datasets.IterableDataset, datasets.IterableDatasetDict)):
        raise TypeError(
            f"{argument}: a streaming {type(value).__name__} has no length, which the held-out split and an exact"
            " mid-epoch resume need. Load it without streaming=True (its rows are memory-mapped, not read into memory)."
        )
    if not isinstance(value, (datasets.Dataset, datasets.DatasetDict)):
        raise TypeError(
            f"{argument}={type(value).__name__} is neither a path nor a datasets.Dataset or DatasetDict. Give"
            f" {READ} files, directories of them, a directory written by save_to_disk, or a dataset."
        )
    return Source(f"the {type(value).__name__} given as {argument}", "object", dataset=value)


def path_sources(item: str | Path, argument: str) -> list[Source]:
    """The sources a path, a glob pattern or a hub id names."""
    text = str(item)
    if any(char in text for char in "*?["):
        matches = [Path(match) for match in sorted(glob.glob(str(Path(text).expanduser()), recursive=True))]
        if not matches:
            raise ValueError(f"{argument}: {text!r} matches no file.")
        files = [match.resolve() for match in matches if match.is_file()]
        if len(files) > 1:
            check_one_split(Path(os.path.commonpath(files)), files, argument, named=text)
        return [source for match in matches for source in path_sources(match, argument)]
    path = Path(item).expanduser()
    if path.is_dir():
        return [Source(str(path), "saved", path)] if is_saved_dataset(path) else directory_sources(path, argument)
    if path.is_file() and path.suffix in READ_SUFFIXES:
        if path.suffix in DATASETS_SUFFIXES:
            import_datasets()  # a missing extra fails now, with its install command
        return [Source(str(path), "native" if path.suffix in NATIVE_SUFFIXES else "file", path)]
    local = path.parent.is_dir() and str(path.parent) != "."  # data/pc.parqet, with data/ here: a local path
    if (
        not path.exists()
        and not local
        and HUB_ID.fullmatch(text)
        and path.suffix not in (*READ_SUFFIXES, *UNREAD_DATA_SUFFIXES)
    ):
        import_datasets()
        return [Source(f"hub dataset {text!r}", "hub", hub_id=text)]
    what = "does not exist" if not path.exists() else f"is not a file this module reads ({path.suffix!r})"
    if not path.exists() and path.parent.is_dir():
        near = closest(path.name, [p.name for p in path.parent.iterdir()], cutoff=0.7)
        what += f" (did you mean {str(path.parent / near)!r}?)" if near else ""
    held_out = " Or leave val_files out (None; --data.val_files null) to hold out val_fraction of the training samples."
    raise ValueError(
        f"{argument}: {text!r} {what}. Give {READ} files, directories of them, a directory written by"
        " save_to_disk, or a hub dataset id such as 'org/name'." + (held_out if argument == "val_files" else "")
    )


def is_saved_dataset(path: Path) -> bool:
    return any((path / marker).is_file() for marker in SAVED_DATASET_MARKERS)


def directory_sources(path: Path, argument: str) -> list[Source]:
    """The readable files and saved datasets under ``path``; unread data files are an error that lists them."""
    saved: list[Path] = []
    files: list[Path] = []
    walk_directory(path, saved, files)
    read = [p for p in files if p.suffix in READ_SUFFIXES and p.name not in METADATA_FILES]
    unread = [p for p in files if p not in read]
    listed = ", ".join(f"{n} {suffix}" for suffix, n in sorted(Counter(p.suffix or p.name for p in unread).items()))
    if any(p.suffix in UNREAD_DATA_SUFFIXES for p in unread):
        raise ValueError(
            f"{argument}: directory {str(path)!r} holds files this module does not read ({listed}) beside"
            f" {len(read)} {READ} files. Convert them to one of these formats, move them out, or name the files to"
            " use instead of the directory."
        )
    if not read and not saved:
        raise ValueError(f"{argument}: directory {str(path)!r} holds no {READ} file and no saved dataset.")
    check_one_split(path, read, argument)
    if any(p.suffix in DATASETS_SUFFIXES for p in read) or saved:
        import_datasets()
    if unread:
        rank_zero_info(
            f"{argument}: {str(path)!r}: read {len(read) + len(saved)} files or datasets; not read: {listed}."
        )
    sources = [Source(str(p), "saved", p) for p in saved]
    return sources + [Source(str(p), "native" if p.suffix in NATIVE_SUFFIXES else "file", p) for p in read]


def walk_directory(path: Path, saved: list[Path], files: list[Path]) -> None:
    """Files under ``path`` in sorted order, hidden ones left out; a saved dataset is one entry, not walked."""
    for child in sorted(path.iterdir()):
        if child.name.startswith("."):
            continue
        if child.is_dir():
            if is_saved_dataset(child):
                saved.append(child)
            else:
                walk_directory(child, saved, files)
        elif child.is_file():
            files.append(child)


def split_of(relative: Path) -> str | None:
    """The split a file belongs to by the hub's layout (``train.jsonl``, ``test-00000-of-00001.parquet``,
    ``validation/x.parquet``), or ``None``."""
    for part in [*relative.parent.parts, relative.stem]:
        match = SPLIT_NAME.fullmatch(part)
        if match:
            return match.group(1).lower()
    return None


def check_one_split(root: Path, files: Sequence[Path], argument: str, named: str | None = None) -> None:
    """Files of several splits under ``root`` (a directory given, or the files a glob ``named`` matched) are
    refused: the held-out split would be trained on."""
    splits: dict[str, list[Path]] = {}
    for file in files:
        split = split_of(file.relative_to(root))
        if split is not None:
            splits.setdefault(split, []).append(file)
    if len(splits) < 2:
        return
    counts = ", ".join(f"{split}: {len(found)}" for split, found in splits.items())
    first = splits[split_for(argument, list(splits))][0]
    split_name = SPLIT_NAME.fullmatch(first.stem)
    pattern = first.parent / f"{split_name.group(1)}*{first.suffix}" if split_name else first.parent
    training = argument.endswith("_files")  # a data module's; else a command's (pl-lowprec generate --prompts)
    why = "would train on the held-out ones" if training else "would mix them"
    given = f"{named!r} matches" if named is not None else f"directory {str(root)!r} holds"
    another = "another's as val_files" if argument == "train_files" else "the training split's as train_files"
    raise ValueError(
        f"{argument}: {given} the files of several splits ({counts} files); reading them all {why}. Name one"
        f" split's files, e.g. {argument}={str(pattern)!r}" + (f", and {another}." if training else ".")
    )


def split_for(argument: str, splits: list[str]) -> str:
    """The split to suggest for ``argument``: ``train`` for training files, a held-out one for ``val_files``."""
    held_out = [split for split in splits if split != "train"]
    wanted = {"train_files": ["train"], "val_files": sorted(held_out, key=HELD_OUT_ORDER.index)}.get(argument, [])
    return next((split for split in wanted if split in splits), splits[0])
