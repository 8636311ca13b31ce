"""A command line's ``--config`` files and ``--key=value`` overrides, read in one place: ``plan`` merges them
into the config it writes, the rebuild hands them to LightningCLI with the run-only keys dropped, and ``export``,
``generate`` and ``plan`` list the files they must never write over."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pl_lowprec._did_you_mean import closest
from pl_lowprec._per_command import PerCommand


@dataclass(frozen=True)
class Option:
    """One argument as given: ``--name=value``, ``--name value``, a bare ``--flag`` (value ``"true"``, as
    jsonargparse reads it) or a positional argument (``name`` empty)."""

    name: str
    value: str
    given: tuple[str, ...]


def options(cli_args: list[str]) -> Iterator[Option]:
    """``cli_args`` as options, in order; an option's value is the next argument unless that is itself an option."""
    index = 0
    while index < len(cli_args):
        arg = cli_args[index]
        name, equals, value = arg.partition("=")
        if not arg.startswith("--"):
            yield Option("", arg, (arg,))
        elif equals:
            yield Option(name, value, (arg,))
        elif index + 1 < len(cli_args) and not cli_args[index + 1].startswith("--"):
            index += 1
            yield Option(name, cli_args[index], (arg, cli_args[index]))
        else:
            yield Option(name, "true", (arg,))
        index += 1


def config_values(cli_args: list[str]) -> list[str]:
    """The values of ``--config``, in order: paths of YAML files, or YAML given inline."""
    return [option.value for option in options(cli_args) if option.name == "--config"]


# configs_read_once's parses, by value (a file's with its size and time): (fields, source)
_READS: PerCommand[dict[tuple[Any, ...], tuple[Any, str]]] = PerCommand("config_reads", dict)


SOURCE_MARK = "# pl-lowprec: from "  # first line of YAML made from a file: where it came from


def inline_from(fields: Any, source: str) -> str:
    """``fields`` as inline YAML for ``--config``, remembering the file they came from (``read_config`` says it);
    inside ``configs_read_once``, ``read_config`` of it gives ``fields`` back without parsing the text."""
    text = f"{SOURCE_MARK}{source}\n{yaml.safe_dump(fields)}"
    reads = _READS.current()
    if reads is not None:
        reads[(text,)] = (fields, source)  # read_config copies what it hands out
    return text


def _is_file(path: Path) -> bool:
    try:
        return path.is_file()
    except OSError:  # YAML given inline, longer than a file name may be
        return False


def _exists(path: Path) -> bool:
    try:
        return path.exists()
    except OSError:  # a name longer than a file name may be: no such file
        return False


def configs_read_once() -> AbstractContextManager[dict[tuple[Any, ...], tuple[Any, str]]]:
    """Inside, each ``--config`` is parsed once: ``config_paragraph``'s checks parse it first, and the later readers
    (``strategy_override``, ``plan``'s merge, the rebuild) get a copy of that parse, not a parse of their own."""
    return _READS.scope()


def _read_key(value: str) -> tuple[Any, ...]:
    """A value's key among the parses kept: a file's with its size and time, so a file written since is read anew."""
    path = Path(value)
    if not _is_file(path):
        return (value,)
    stat = path.stat()
    return (value, stat.st_size, stat.st_mtime_ns)


def read_config(value: str) -> tuple[Any, str]:
    """A ``--config`` value's fields (a YAML file's, or the YAML given inline) and where they come from, in words:
    the file's path, also for YAML that ``inline_from`` made of a file. Inside ``configs_read_once`` a value is
    parsed once and each reader gets its own copy (some set keys in what they read)."""
    reads = _READS.current()
    if reads is None:
        return _parsed(value)
    fields, source = _READS.cached(_read_key(value), lambda: _parsed(value))
    return copy.deepcopy(fields), source


def _parsed(value: str) -> tuple[Any, str]:
    path = Path(value)
    if _is_file(path):
        return yaml.safe_load(path.read_text()), str(path)
    first, _, _ = value.partition("\n")
    source = first.removeprefix(SOURCE_MARK) if first.startswith(SOURCE_MARK) else "the --config given inline"
    return yaml.safe_load(value), source


@dataclass(frozen=True)
class _Read:
    """One ``--config`` value, parsed once: its fields and their source, or the error that stopped the parse."""

    value: str
    fields: Any = None
    source: str = ""
    error: Exception | None = None


def _read(value: str) -> _Read:
    try:
        fields, source = read_config(value)
    except (yaml.YAMLError, UnicodeDecodeError, OSError) as err:
        return _Read(value, error=err)
    return _Read(value, fields, source)


def _missing_paragraph(read: _Read) -> str | None:
    """A value that YAML reads as a plain string, not as inline YAML's mapping, and names no file: jsonargparse
    words it as 'Parser key "config": File does not exist'; here with the nearest YAML file of that directory,
    or of ``configs/`` for a bare name."""
    path = Path(read.value)
    if read.error is not None or not isinstance(read.fields, str) or _exists(path):
        return None
    folder = path.parent if path.parent != Path() or not Path("configs").is_dir() else Path("configs")
    found = {yaml_file.stem: yaml_file for yaml_file in folder.glob("*.y*ml")} if folder.is_dir() else {}
    near = closest(path.stem, found)  # by the name alone: every .yaml shares the suffix
    near = str(found[near]) if near else None
    where = "" if path.is_absolute() else f" (relative to {Path.cwd()})"
    return (
        f"--config {read.value} does not exist{where}.{f' Did you mean {near}?' if near else ''} A config is a"
        " YAML file (`pl-lowprec fit --print_config` writes a full one to start from; the repository's are"
        " in configs/), or YAML given inline: --config 'trainer: {max_steps: 10}'."
    )


def _unreadable_paragraph(read: _Read) -> str | None:
    """A value (a file, or YAML given inline) that is not YAML: where, and what the parser found, with the line
    at fault. Every reader of the configs (``strategy_override``, ``plan``, jsonargparse) would otherwise meet
    it first, the package's own with a traceback."""
    err = read.error
    if isinstance(err, yaml.MarkedYAMLError):
        named = f"--config {read.value}" if _is_file(Path(read.value)) else "the --config given inline"
        mark = err.problem_mark
        where = ""
        if mark is not None:
            lines = (mark.buffer or "").rstrip("\0").splitlines()  # the text parsed (the reader ends it with NUL)
            line = lines[mark.line] if mark.line < len(lines) else ""
            where = f" at line {mark.line + 1}, column {mark.column + 1} ({line.strip()!r})"
        return (
            f"{named} is not valid YAML: {err.problem or err.context}{where}. Keys of one section are indented"
            " by the same number of spaces (no tabs), and a value with ': ' or '#' in it is quoted; `pl-lowprec"
            " fit --print_config` writes a config that reads."
        )
    if err is not None:
        return f"--config {read.value} is not a YAML file ({type(err).__name__}: {err}); a config is YAML text."
    return None


def _empty_paragraph(read: _Read) -> str | None:
    """A file that holds nothing (empty, or only comments), which jsonargparse reports as "Unexpected config"
    without its name."""
    if read.error is not None or read.fields is not None:
        return None
    named = f"--config {read.source}" if read.source == read.value else read.source
    return (
        f"{named} holds nothing (it is empty, or only comments): a config is YAML with the sections"
        " that `pl-lowprec fit --print_config` shows (trainer:, model:, data:). Fill it, or leave it out."
    )


def config_paragraph(cli_args: list[str]) -> str | None:
    """The refusal of the first bad ``--config`` in ``cli_args``, each read once: a missing file first (of
    any of them), then one that is not YAML, then one that holds nothing; ``None`` where every one reads."""
    reads = [_read(value) for value in config_values(cli_args)]
    for check in (_missing_paragraph, _unreadable_paragraph, _empty_paragraph):
        for read in reads:
            paragraph = check(read)
            if paragraph is not None:
                return paragraph
    return None
