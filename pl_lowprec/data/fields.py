"""The user's column names mapped to the fields ``TextDataModule`` reads; ShareGPT and alpaca records as ``messages``.

A record is read by its fields: ``text``; ``prompt`` + ``completion``; ``messages`` (a list of ``{role, content}``).
``fields`` names the user's columns for them, as renaming the columns by hand would: ``{"prompt": "question",
"completion": "answer"}``. With a mapping, only the columns it names are read, and the chat template's ``tools`` and
``chat_template_kwargs``. ShareGPT chats (a ``conversations`` column of ``{from, value}`` turns, roles
``human``/``gpt``/``system``) are read as ``messages`` with the roles ``user``/``assistant``/``system``, as TRL's
``maybe_convert_to_chatml`` does, LLaMA-Factory's tool-use roles ``function_call``/``observation`` as an assistant
turn's ``tool_calls`` and a ``tool`` turn (``sharegpt_tools``), and a ``system`` column beside them as their first turn
(LLaMA-Factory's ShareGPT); under another column name, map it with ``{"messages": COLUMN}``. Roles outside
system/user/assistant/tool that the template does not name are refused (``chat_roles``). Alpaca records
(``instruction``, ``output``, optionally ``input``, ``system`` and ``history``, the format of Stanford Alpaca and of
LLaMA-Factory's datasets) are read as ``messages`` as LLaMA-Factory reads them: the instruction and its input joined by
a newline as the user's turn, the output as the answer, the history's pairs before them. A value that is absent
(``None``, as Arrow tables hold for a field a record lacks) is read as a missing field, so a ``.jsonl`` file and its
Parquet copy give the same records. A prompt/completion record that lacks one of the two is told the columns it has and
the mapping that reads the missing field from them (``missing_field_reason``): a file whose answers are under
``response`` was told "'prompt' and 'completion' not both strings".
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from pl_lowprec.data.chat import TEMPLATE_FIELDS
from pl_lowprec.data.sharegpt_tools import tool_use_turn

FIELD_NAMES = ("text", "prompt", "completion", "messages")
FORMATS = ({"text"}, {"prompt", "completion"}, {"messages"})
SHAREGPT_COLUMN = "conversations"
ALPACA_COLUMNS = ("instruction", "output")  # and optionally input, system, history (LLaMA-Factory's alpaca format)
READ_COLUMNS = frozenset({*FIELD_NAMES, SHAREGPT_COLUMN, *ALPACA_COLUMNS})  # what is read without a mapping
# axolotl's chat_template default ``roles`` (user <- human, assistant <- gpt; system, tool as they are), read in
# {role, content} turns too; LLaMA-Factory's default user_tag and assistant_tag are the same two
ROLE_ALIASES = {"human": "user", "gpt": "assistant"}
SHAREGPT_ROLES = {**ROLE_ALIASES, "system": "system", "observation": "tool"}
EXAMPLE = (
    "fields={'prompt': 'question', 'completion': 'answer'} (--data.fields '{prompt: question, completion: answer}')"
)


def check_fields(fields: dict[str, str] | None) -> dict[str, str] | None:
    """``fields`` as a plain dict, or a ``ValueError`` that names what is wrong and what is allowed."""
    if fields is None:
        return None
    if not isinstance(fields, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in fields.items()):
        raise ValueError(f"TextDataModule(fields={fields!r}) must map field names to column names, e.g. {EXAMPLE}.")
    unknown = sorted(set(fields) - set(FIELD_NAMES))
    if unknown or set(fields) not in FORMATS:
        what = f"{unknown} are not fields it reads" if unknown else f"{sorted(fields)} is not one format"
        raise ValueError(
            f"TextDataModule(fields={fields!r}): {what}. A mapping names the columns of one format: {{text}},"
            f" {{prompt, completion}} or {{messages}}, each mapped to a column of your records, e.g. {EXAMPLE}."
        )
    return dict(fields)


def read_fields(record: dict[str, Any], fields: dict[str, str] | None) -> dict[str, Any]:
    """The record under the field names ``TextDataModule`` reads (see the module docstring)."""
    if fields is not None:
        extras = {name: record[name] for name in TEMPLATE_FIELDS if name in record}
        record = {name: record[column] for name, column in fields.items() if column in record} | extras
    record = {key: value for key, value in record.items() if value is not None}
    sharegpt = fields is None and "messages" not in record and SHAREGPT_COLUMN in record
    if sharegpt:
        record["messages"] = record.pop(SHAREGPT_COLUMN)
    if isinstance(record.get("messages"), str):  # a CSV cell, or a table that stores the turns as JSON text
        record["messages"] = json_list(record["messages"])
    if fields is None and not {"messages", "prompt", "completion"} & record.keys() and is_alpaca(record):
        record["messages"] = alpaca_turns(record)
    for name in ("messages", "prompt", "completion"):  # TRL's conversational prompt/completion: lists of turns
        if isinstance(record.get(name), list):
            record[name] = [chat_turn(turn) for turn in record[name]]
    if sharegpt:  # after chat_turn: a system turn of the conversation's own has its role by now
        record["messages"] = with_system_column(record["messages"], record.get("system"))
    return record


def json_list(text: str) -> Any:
    """``text`` as the JSON list it holds; the text itself where it holds none (counted as no list of turns)."""
    if not text.lstrip().startswith("["):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def with_system_column(turns: Any, system: Any) -> Any:
    """ShareGPT ``turns`` with the record's ``system`` column as their first turn, as LLaMA-Factory reads its
    ShareGPT format (a system turn of the conversation's own comes first instead). Left unread, the template
    rendered its default system prompt, or none, in its place."""
    if not isinstance(turns, list) or not isinstance(system, str) or not system.strip():
        return turns
    first = turns[0] if turns else None
    if isinstance(first, dict) and first.get("role") == "system":
        return turns
    return [{"role": "system", "content": system}, *turns]


def is_alpaca(record: dict[str, Any]) -> bool:
    return all(isinstance(record.get(column), str) for column in ALPACA_COLUMNS)


def alpaca_turns(record: dict[str, Any]) -> list[Any]:
    """An alpaca record as LLaMA-Factory reads it: ``system``, the ``history`` pairs, then one user turn of the
    ``instruction`` and its ``input`` (joined by a newline) answered by the ``output``."""
    turns: list[Any] = [{"role": "system", "content": record["system"]}] if record.get("system") else []
    for pair in record.get("history") or []:
        question, answer = pair if isinstance(pair, (list, tuple)) and len(pair) == 2 else (None, None)
        turns += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    query = "\n".join(part for part in (record["instruction"], record.get("input")) if isinstance(part, str) and part)
    return [*turns, {"role": "user", "content": query}, {"role": "assistant", "content": record["output"]}]


def chat_turn(turn: Any) -> Any:
    """A ``{role, content}`` turn, its role ``human``/``gpt`` renamed as axolotl's default ``roles`` rename them; a
    ShareGPT ``{from, value}`` turn converted, with its role renamed."""
    if not isinstance(turn, dict):
        return turn
    turn = {key: value for key, value in turn.items() if value is not None}
    if "role" not in turn and "from" in turn and "value" in turn:
        tool_use = tool_use_turn(turn["from"], turn["value"])
        return tool_use or {"role": SHAREGPT_ROLES.get(turn["from"], turn["from"]), "content": turn["value"]}
    if isinstance(turn.get("role"), str) and turn["role"] in ROLE_ALIASES:
        return turn | {"role": ROLE_ALIASES[turn["role"]]}
    return turn


def missing_field_reason(field: str, given: dict[str, Any], fields: dict[str, str] | None) -> str:
    """Why a prompt/completion record lacking ``field`` is unusable, in the record's own column names (``given``:
    the record before the mapping), with the mapping that reads it from the record's other columns."""
    columns = sorted(key for key, value in given.items() if value is not None)
    if fields is not None:
        return f"records without the column {fields[field]!r}, which fields maps to {field!r} (they have {columns})"
    reason = f"records with no {field!r} field (they have {columns})"
    others = [column for column in columns if column not in READ_COLUMNS and column not in TEMPLATE_FIELDS]
    if len(others) > 1:
        return f"{reason}: map one of {others} to it with a field mapping, e.g. {EXAMPLE}"
    if not others:
        return reason
    mapping = {name: others[0] if name == field else name for name in ("prompt", "completion")}
    cli = ", ".join(f"{name}: {column}" for name, column in mapping.items())
    return f"{reason}: map it with fields={mapping!r} (--data.fields '{{{cli}}}')"


def unread_columns(columns: Iterable[str], fields: dict[str, str] | None) -> list[str]:
    """The columns a mapping leaves unread (an alpaca ``input`` beside ``{prompt: instruction, completion:
    output}`` would be lost in silence): named in the log."""
    if fields is None:
        return []
    return sorted(set(columns) - set(fields.values()) - set(TEMPLATE_FIELDS))


def columns_read(fields: dict[str, str] | None, unmapped: Iterable[str] = READ_COLUMNS) -> frozenset[str]:
    """The columns a table is read by: those ``fields`` names, else ``unmapped`` (by default every one training
    reads without a mapping)."""
    return frozenset(unmapped if fields is None else fields.values())


def check_columns(columns: Iterable[str], fields: dict[str, str] | None, source: str) -> None:
    """A mapping that names a column ``source`` lacks, or a table with no column to read, is refused."""
    columns = sorted(columns)
    if fields is not None:
        missing = [column for column in fields.values() if column not in columns]
        if missing:
            raise ValueError(
                f"{source}: fields={fields!r} names the column(s) {missing}, which it does not have; its columns are"
                f" {columns}. Map each field to one of them."
            )
        return
    if not set(columns) & READ_COLUMNS:
        raise ValueError(
            f"{source} has the columns {columns}, none of which TextDataModule reads (text; prompt and completion;"
            f" messages; ShareGPT's conversations; alpaca's instruction and output). Name yours with a field mapping,"
            f" e.g. {EXAMPLE}."
        )
