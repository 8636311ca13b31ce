"""The prompts ``pl-lowprec generate`` completes, read from what ``TextDataModule`` trains on.

A ``.txt`` file is one prompt per non-empty line. Everything else is what ``val_files`` takes
(``pl_lowprec.data.sources``): ``.jsonl``, and through Hugging Face ``datasets`` (``pl_lowprec[datasets]``)
``.parquet``, ``.csv``, ``.json`` and ``.arrow`` files, a ``save_to_disk`` directory, a hub id, directories and glob
patterns of them; a ``DatasetDict`` gives its ``validation`` split, else ``test`` (``--split NAME`` for another).
Each record is read by the training data's rules (``pl_lowprec.data.fields``): a ``prompt`` (a string, or TRL's
list of turns) with an optional ``completion`` (the reference), ``messages``, ShareGPT ``conversations``, or alpaca
``instruction``/``output``. ``fields`` names the user's columns for them as ``TextDataModule(fields=...)`` does,
and may name a prompt alone; so a run's own held-out file, in its own columns, is read as it trained on it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

from pl_lowprec.data.chat import turns_problem
from pl_lowprec.data.dataset_files import open_dataset
from pl_lowprec.data.fields import SHAREGPT_COLUMN, check_columns, columns_read, read_fields
from pl_lowprec.data.sources import Source, resolve_sources
from pl_lowprec.data.text import VAL_SPLITS

OPTION = "--prompts"
PROMPT_FORMATS = ({"prompt"}, {"prompt", "completion"}, {"messages"})
PROMPT_COLUMNS = {"prompt", "messages", SHAREGPT_COLUMN, "instruction"}  # alpaca's instruction (and its output)
FIELDS_EXAMPLE = "--fields '{prompt: question, completion: answer}'"


def check_prompt_fields(fields: Any) -> dict[str, str] | None:
    """``--fields`` as a plain dict, or a ``ValueError`` that names what is wrong and what is allowed."""
    if fields is None:
        return None
    if not isinstance(fields, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in fields.items()):
        raise ValueError(f"--fields {fields!r} must map field names to column names, e.g. {FIELDS_EXAMPLE}.")
    if set(fields) not in PROMPT_FORMATS:
        raise ValueError(
            f"--fields {fields!r}: {sorted(fields)} is not a format of prompts. A mapping names the columns of one:"
            f" {{prompt}}, {{prompt, completion}} (the completion is written as the reference) or {{messages}},"
            f" e.g. {FIELDS_EXAMPLE}."
        )
    return dict(fields)


def prompt_fields_of_run(fields: dict[str, str] | None) -> dict[str, str] | None:
    """A run's ``TextDataModule(fields=...)`` where it names prompts (a ``{text}`` mapping names none)."""
    return dict(fields) if isinstance(fields, dict) and set(fields) in PROMPT_FORMATS else None


def prompt_sources(prompts: str | Path) -> list[Source]:
    """What ``--prompts`` names, checked before anything loads: it exists, and is a format that is read."""
    return resolve_sources(str(prompts), OPTION)


def read_prompts(
    prompts: str | Path | list[Source],
    chat: bool = False,
    fields: dict[str, str] | None = None,
    splits: tuple[str, ...] = VAL_SPLITS,
    limit: int | None = None,
) -> list[dict[str, Any]]:
    """Records with a ``prompt`` or ``messages``, in the order of the sources and their lines or rows; the first
    ``limit`` of them (the rest is not read: a look at a large test split). With ``chat``, a plain prompt also gets
    ``messages``: the prompt as one user turn."""
    sources = prompts if isinstance(prompts, list) else prompt_sources(prompts)
    records: list[dict[str, Any]] = []
    for source in sources:
        left = None if limit is None else limit - len(records)
        if left == 0:
            break
        found = list(islice(_source_records(source, fields, splits), left))
        if not found:
            raise ValueError(f"{OPTION} {source.label!r} holds no prompt.")
        records += found
    if chat:
        records = [
            r if "messages" in r else r | {"messages": [{"role": "user", "content": r["prompt"]}]} for r in records
        ]
    return records


def _source_records(source: Source, fields: dict[str, str] | None, splits: tuple[str, ...]) -> Iterator[dict]:
    if source.kind == "native" and source.path.suffix == ".txt":
        lines = source.path.read_text(encoding="utf-8").splitlines()
        yield from ({"prompt": line} for line in lines if line.strip())
    elif source.kind == "native":
        for number, line in _lines(source.path):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{source.path}:{number}: not valid JSON ({err.msg}).") from err
            yield prompt_record(record, fields, f"{source.path}:{number}", line.rstrip("\n"))
    else:
        read_columns = columns_read(fields, unmapped=PROMPT_COLUMNS)
        dataset, label = open_dataset(source, splits, OPTION, split_option="--split NAME", read_columns=read_columns)
        _check_prompt_columns(dataset.column_names, fields, label)
        for index, row in enumerate(dataset):
            yield prompt_record(row, fields, f"{label}, row {index}", repr(row))


def _check_prompt_columns(columns: list[str], fields: dict[str, str] | None, label: str) -> None:
    """A table whose columns hold no prompt, or lack a column ``fields`` names, is refused before its rows."""
    if fields is not None:
        check_columns(columns, fields, label)
    elif not PROMPT_COLUMNS & set(columns):
        raise ValueError(
            f"{label} has the columns {sorted(columns)}, none of which holds prompts (prompt, with completion as"
            f" the reference; messages; ShareGPT's conversations; alpaca's instruction and output). Name yours with"
            f" {FIELDS_EXAMPLE}."
        )


def prompt_record(record: Any, fields: dict[str, str] | None, where: str, shown: str) -> dict[str, Any]:
    """One record read as ``TextDataModule`` reads it, then checked for a prompt; ``where`` names it in errors."""
    if isinstance(record, dict):
        record = read_fields(record, fields)
    if isinstance(record, dict) and isinstance(record.get("prompt"), list):
        record = _conversational_as_messages(record)
    if isinstance(record, dict) and "messages" in record:
        problem = turns_problem(record["messages"])
        if problem:
            raise ValueError(
                f"{where}: 'messages' (or a 'prompt' list) must be a list of {{role, content}} turns, and it"
                f" holds {problem}; got {shown[:80]!r}."
            )
        if not chat_turns(record):
            raise ValueError(f"{where}: 'messages' holds no turn before its last assistant turn.")
        return record
    if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
        mapped = f", read under the fields {fields!r} (name this file's own columns with --fields)" if fields else ""
        raise ValueError(
            f"{where}: each record needs a 'prompt' (a string or a list of turns) or a 'messages' list{mapped};"
            f" got {shown[:80]!r}."
        )
    return record


def chat_turns(record: dict[str, Any]) -> list[dict[str, str]]:
    """The turns the model answers: ``messages`` without a trailing assistant turn (that is the reference)."""
    messages = record["messages"]
    return messages[:-1] if messages and messages[-1]["role"] == "assistant" else messages


def _conversational_as_messages(record: dict[str, Any]) -> dict[str, Any]:
    """TRL's conversational prompt/completion as a chat record: the prompt's turns, then the completion's one
    assistant turn (the reference); a completion of several turns (a tool call and its answer) is no reference."""
    turns = list(record.pop("prompt"))
    completion = record.pop("completion", None)
    if isinstance(completion, list) and len(completion) == 1 and _is_assistant_turn(completion[0]):
        turns += completion
    return record | {"messages": turns}


def _is_assistant_turn(turn: Any) -> bool:
    return isinstance(turn, dict) and turn.get("role") == "assistant"


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                yield number, line
