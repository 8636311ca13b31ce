"""A strategy's whole signature, as ``inspect.signature``, ``help()`` and notebook completion show it.

Each strategy's ``__init__`` takes only its own arguments and passes the rest on with ``**kwargs``: the model
arguments to ``TransformArguments`` (declared and documented once there), the others to the Lightning strategy.
Python's own signature of such a class stops at the first ``**kwargs`` (``(device=None, **kwargs)``); this one
follows ``**kwargs`` through the bases, as jsonargparse does for ``pl-lowprec fit --help``, up to and including
the Lightning strategy. What a class passes to its base itself (``ARGUMENTS_SET_HERE``) is left out, since the
base would then receive it twice.
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
