"""A strategy's whole signature and its docs, as ``inspect.signature``, ``help()`` and notebook completion show them.

Each strategy's ``__init__`` takes only its own arguments and passes the rest on with ``**kwargs``: the model
arguments to ``TransformArguments`` (declared and documented once there), the others to the Lightning strategy.
Python's own signature of such a class stops at the first ``**kwargs`` (``(device=None, **kwargs)``); this one
follows ``**kwargs`` through the bases, as jsonargparse does for ``pl-lowprec fit --help``, up to and including
the Lightning strategy. What a class passes to its base itself (``ARGUMENTS_SET_HERE``) is left out, since the
base would then receive it twice.

The model arguments are documented once, on ``TransformArguments``; ``help()`` shows only the class's own
docstring, so ``with_shared_arguments`` copies their entries into each strategy's ``Args:`` section.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable

FOREIGN_BASE_PREFIX = "lightning."  # the first base from Lightning ends the walk: its **kwargs are its own


def forwarded_signature(cls: type, set_here: Iterable[str] = ()) -> inspect.Signature:
    """The arguments ``cls(...)`` accepts: each ``__init__`` in the MRO that ``**kwargs`` reaches, own first.

    Arguments of later ``__init__``s can only arrive through ``**kwargs``, so they are keyword-only here."""
    skipped = set(set_here)
    parameters: dict[str, inspect.Parameter] = {}
    var_keyword: inspect.Parameter | None = None
    through_kwargs = False
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or klass is object:
            continue
        own = list(inspect.signature(init).parameters.values())[1:]  # without self
        var_keyword = next((p for p in own if p.kind is p.VAR_KEYWORD), None)
        for parameter in own:
            if parameter.kind in (parameter.VAR_KEYWORD, parameter.VAR_POSITIONAL):
                continue
            if parameter.name in parameters or parameter.name in skipped:
                continue
            if through_kwargs:
                parameter = parameter.replace(kind=parameter.KEYWORD_ONLY)
            parameters[parameter.name] = parameter
        through_kwargs = True
        if var_keyword is None or klass.__module__.startswith(FOREIGN_BASE_PREFIX):
            break
    ordered = sorted(parameters.values(), key=lambda p: p.kind)  # stable: each kind keeps its order
    return inspect.Signature([*ordered, *([var_keyword] if var_keyword is not None else [])])


def keyword_arguments(cls: type) -> list[str]:
    """The names a config section of ``cls`` may hold (``forwarded_signature`` without ``**kwargs``): what the
    refusals of a mistyped or misplaced config key compare the key against."""
    return [n for n, p in forwarded_signature(cls).parameters.items() if p.kind is not p.VAR_KEYWORD]


ARGS_HEADING = "Args:"


def args_entries(docstring: str) -> list[str]:
    """The lines of a Google-style docstring's ``Args:`` section, without its heading (none: empty)."""
    lines = inspect.cleandoc(docstring).splitlines()
    if ARGS_HEADING not in lines:
        return []
    section = lines[lines.index(ARGS_HEADING) + 1 :]
    end = next((i for i, line in enumerate(section) if line and not line.startswith(" ")), len(section))
    return section[:end]


def argument_blocks(entries: list[str]) -> dict[str, list[str]]:
    """``{argument: its lines}`` of an ``Args:`` section: each entry's first line and its continuation."""
    blocks: dict[str, list[str]] = {}
    indent = min((len(line) - len(line.lstrip()) for line in entries if line.strip()), default=0)
    for line in entries:
        if line.strip() and len(line) - len(line.lstrip()) == indent:
            blocks[line.strip().partition(":")[0]] = [line]
        elif blocks:
            blocks[next(reversed(blocks))].append(line)
    return blocks


def with_shared_arguments(docstring: str | None, shared: str) -> str | None:
    """``docstring`` with the ``Args:`` entries of ``shared`` added to its own, before its ``**kwargs`` entry.

    An argument the docstring documents itself keeps its own entry (a subclass of a strategy, whose docstring
    already has them all, gets nothing twice); a class without a docstring keeps none, and ``help()`` then shows
    its base's."""
    if docstring is None:
        return None
    own_lines = args_entries(docstring)
    own = argument_blocks(own_lines)
    added = [line for name, block in argument_blocks(args_entries(shared)).items() if name not in own for line in block]
    added = [line for line in added if line.strip()]
    if not added:
        return docstring
    lines = inspect.cleandoc(docstring).splitlines()
    if ARGS_HEADING not in lines:
        return "\n".join([*lines, "", ARGS_HEADING, *added])
    start = lines.index(ARGS_HEADING) + 1
    at = next((start + i for i, line in enumerate(own_lines) if line.strip().startswith("**kwargs")), None)
    if at is None:
        at = start + len(own_lines)
        while at > start and not lines[at - 1].strip():
            at -= 1
    return "\n".join([*lines[:at], *added, *lines[at:]])
