"""Records written to a ``.jsonl`` file and read by ``TextDataModule``, as a test of the record paths sets them up;
its rows as plain lists, to compare."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pl_lowprec.data import TextDataModule


def data_of_records(path: Path, records: list[dict[str, Any]], tokenizer: str, **kwargs: Any) -> TextDataModule:
    """``records`` as ``path`` (one JSON object a line), set up for fit with nothing held out."""
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    data = TextDataModule(train_files=path, tokenizer=tokenizer, val_fraction=0, **kwargs)
    data.setup("fit")
    return data


def rows_as_lists(rows: Any) -> list[dict[str, list[int]]]:
    """Every row of ``rows`` (a list or a dataset of token tensors) as lists: rows compare with ``==`` and a
    failure prints the tokens."""
    return [{key: value.tolist() for key, value in rows[i].items()} for i in range(len(rows))]
