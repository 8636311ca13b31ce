"""``estimate --json`` and ``plan --json``: stdout holds the JSON object alone, so everything a command prints for
a person (tables, notes, Lightning's lines) goes to stderr while it runs."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def for_a_person(json_wanted: bool) -> Iterator[None]:
    """Inside: ``print`` writes to stderr where ``--json`` was given, to stdout (as always) where not."""
    if not json_wanted:
        yield
        return
    with contextlib.redirect_stdout(sys.stderr):
        yield
