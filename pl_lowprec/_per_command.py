"""One value that every reader inside a ``pl-lowprec`` command shares: the parsed ``--config`` files, the resolved
``pretrained_adapter`` directories, the open weight files.

Held in a context variable, so each ``main()`` call (and each test calling it) starts without one: the outermost
``scope()`` makes the value, the scopes nested in it take that one, and the outermost closes it when it ends.
Outside any scope, ``current()`` is None and each reader does its own work.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Generic, TypeVar

T = TypeVar("T")


class PerCommand(Generic[T]):
    """``make`` builds the value when the outermost scope starts; ``close`` (if given) ends it with that scope."""

    def __init__(self, name: str, make: Callable[[], T], close: Callable[[T], object] | None = None) -> None:
        self._value: ContextVar[T | None] = ContextVar(name, default=None)
        self._make = make
        self._close = close

    def current(self) -> T | None:
        """The value of the scope around the caller, or None outside any."""
        return self._value.get()

    def cached(self, key: object, make: Callable[[], object]) -> object:
        """For a value that is a dict: ``make()`` once per ``key`` inside a scope, each time outside any."""
        store = self._value.get()
        if store is None:
            return make()
        if key not in store:
            store[key] = make()
        return store[key]

    @contextmanager
    def scope(self) -> Iterator[T]:
        """The value of the scope around this one, else a new one for this block (also usable as a decorator)."""
        outer = self._value.get()
        if outer is not None:
            yield outer
            return
        value = self._make()
        token = self._value.set(value)
        try:
            yield value
        finally:
            self._value.reset(token)
            if self._close is not None:
                self._close(value)
