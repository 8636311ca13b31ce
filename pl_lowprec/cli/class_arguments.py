"""The keyword arguments a class takes, as a config section of it would: what the refusals of a mistyped or
misplaced config key compare the key against (``own_options.meant_config_key``, ``misplaced_keys``)."""

from __future__ import annotations

import inspect


def keyword_arguments(cls: type) -> list[str]:
    """The keyword arguments of ``cls``, those of its bases included where it passes ``**kwargs`` on."""
    names: list[str] = []
    for klass in inspect.getmro(cls):
        if "__init__" not in vars(klass):
            continue
        parameters = inspect.signature(klass.__init__).parameters
        names += [n for n, p in parameters.items() if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if not any(p.kind == p.VAR_KEYWORD for p in parameters.values()):
            break
    return names
