"""Sources read through Hugging Face ``datasets``, each opened as one ``datasets.Dataset`` (an Arrow table).

- ``.parquet``, ``.csv``, ``.json``: ``load_dataset(builder, data_files=...)``, which converts the file once into
  an Arrow file in the ``datasets`` cache (``HF_DATASETS_CACHE``) and memory-maps it, as axolotl reads them. CSV
  columns are read as text (an answer ``42`` stays the string ``"42"``); only an empty cell is a missing value.
- ``.arrow``: memory-mapped where it lies (``Dataset.from_file``, the stream format ``datasets`` writes); the
  Arrow IPC file format (Feather v2) goes through ``load_dataset("arrow")``.
- a ``save_to_disk`` directory: ``load_from_disk``, memory-mapped where it lies.
- a hub id: ``load_dataset(org/name)``, which needs the network (not tested here: these machines have none).
A ``DatasetDict`` (a saved one, a hub dataset, or one passed in Python) gives the split asked for. A ``.json`` file
that is one object holding its records as a list under a key (``{"version": 1, "data": [...]}``, as SQuAD is
published) is read from that list, as ``load_dataset("json", field="data")`` reads it, where no other column is read.
"""

from __future__ import annotations

import csv
from collections.abc import Collection
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from pl_lowprec._error_text import briefly
from pl_lowprec._imports import import_datasets
from pl_lowprec.data.sources import Source

BUILDERS = {".parquet": "parquet", ".csv": "csv", ".json": "json", ".arrow": "arrow"}


def open_dataset(
    source: Source,
    splits: tuple[str, ...],
    argument: str,
    split_option: str | None = None,
    read_columns: Collection[str] = (),
) -> tuple[Any, str]:
    """``source`` as a ``datasets.Dataset`` (the first of ``splits`` it has, if it has splits) and its label.
    ``split_option`` is how the caller's user names a split (``--split NAME``); by default the data module's.
    ``read_columns``: the columns the caller reads; a ``.json`` object with none of them may hold its records under
    a key (``records_under_a_key``)."""
    datasets = import_datasets()
    if source.kind == "object":
        found = source.dataset
    elif source.kind == "saved":
        found = datasets.load_from_disk(str(source.path))
    elif source.kind == "hub":
        found = load_hub_dataset(datasets, source.hub_id, argument)
    else:
        found = records_under_a_key(datasets, read_file(datasets, source.path), source.path, read_columns)
    if not isinstance(found, datasets.DatasetDict):
        return found, source.label
    split = next((name for name in splits if name in found), None)
    if split is None:
        split_argument = argument.replace("_files", "_split")
        option = split_option or f"{split_argument}=NAME (--data.{split_argument} NAME)"
        raise ValueError(
            f"{source.label} has the splits {list(found)}, and none of {list(splits)}. Name the split to read:"
            f" {option}."
        )
    others = [name for name in found if name != split]
    if others:
        rank_zero_info(f"{argument}: {source.label}: read its {split!r} split; not read: {others}.")
    return found[split], f"{source.label} (split {split!r})"


def records_under_a_key(datasets: Any, dataset: Any, path: Path, read_columns: Collection[str]) -> Any:
    """A ``.json`` file read as one row whose columns hold none of ``read_columns``, and one of them a list of
    objects: that list's records, said in one line. Several such lists: refused, naming them (which one is the
    training data is not for this package to guess). Any other dataset as it is."""
    if path.suffix != ".json" or len(dataset) != 1 or set(dataset.column_names) & set(read_columns):
        return dataset
    lists = [name for name, feature in dataset.features.items() if lists_records(datasets, feature)]
    if len(lists) > 1:
        raise ValueError(
            f"{path} is one JSON object with lists of records under the keys {lists}; which to read is not clear."
            f" Write the one to train on as its own file, e.g. python -c \"import json; d = json.load(open('{path}'));"
            f" open('{lists[0]}.jsonl', 'w').writelines(json.dumps(r) + '\\n' for r in d['{lists[0]}'])\"."
        )
    if not lists:
        return dataset
    others = [name for name in dataset.column_names if name != lists[0]]
    rank_zero_info(
        f"{path}: one JSON object; read the records listed under its key {lists[0]!r}"
        + (f"; not read: {others}." if others else ".")
    )
    return read_file(datasets, path, field=lists[0])


def lists_records(datasets: Any, feature: Any) -> bool:
    """Whether a column's feature is a list of objects: of one shape (a struct), or of several (``Json``)."""
    if not isinstance(feature, datasets.List):
        return False
    return isinstance(feature.feature, dict) or type(feature.feature).__name__ == "Json"


def read_file(datasets: Any, path: Path, **json_options: Any) -> Any:
    """A ``.parquet``, ``.csv``, ``.json`` or ``.arrow`` file as a memory-mapped ``datasets.Dataset``;
    ``json_options`` (``field``) go to the json builder."""
    builder = BUILDERS[path.suffix]
    try:
        if builder == "arrow":
            try:
                return datasets.Dataset.from_file(str(path))
            except Exception:  # the Arrow IPC file format (Feather v2), which from_file does not map
                pass
        options = csv_options(path) if builder == "csv" else json_options
        return datasets.load_dataset(builder, data_files=str(path), split="train", **options)
    except Exception as err:  # a malformed file: every kind of error needs the same message
        raise ValueError(
            f"{path}: it could not be read as a {builder} file by Hugging Face datasets ({briefly(err, 300)})."
        ) from err


def csv_options(path: Path) -> dict[str, Any]:
    """Every column read as text, and only an empty cell read as a missing value (not ``NA``, ``None``, ...)."""
    datasets = import_datasets()
    with path.open(newline="", encoding="utf-8") as handle:
        header = next(csv.reader(handle), [])
    features = datasets.Features({name: datasets.Value("string") for name in header})
    return {"features": features, "keep_default_na": False, "na_values": [""]}


def load_hub_dataset(datasets: Any, hub_id: str, argument: str) -> Any:
    """A dataset from the Hugging Face Hub (needs the network), or an error that says what to do without it."""
    try:
        return datasets.load_dataset(hub_id)
    except Exception as err:  # offline, unknown or gated repository: every one needs the same advice
        raise ValueError(
            f"{argument}: {hub_id!r} is not a local file or directory, and loading it from the Hugging Face Hub"
            f" failed ({briefly(err, 200)}). On a machine with network access, run"
            f" `datasets.load_dataset({hub_id!r}).save_to_disk(DIR)` and pass DIR."
        ) from err
