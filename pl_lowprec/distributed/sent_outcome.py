"""A step one process computes while the others wait in a collective for its outcome: its result pickled, or its
error as a ``Failure``, sent before the computing process raises.

Why one place: the waiting processes have no timeout, so anything that goes wrong on the computing process must
reach them as an outcome. Pickling the result inside the step's own ``try`` makes a result that does not pickle
one more failure to send, instead of an error raised in the collective's pickling while the others wait for
ever. Used by ``once_per_node`` (a node's first process, an all-gather) and the strategies' ``on_rank_zero``
(rank 0, a broadcast).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")


@dataclass
class Failure:
    """The computing process's error, as the other processes raise it."""

    message: str
    pickled: bytes | None  # the exception itself, where it pickles
    refused: bool = False  # the caller's ``refused(err)``: the traceback that may tell it is not sent

    @classmethod
    def of(cls, err: Exception, refused: bool = False) -> Failure:
        try:
            pickled = pickle.dumps(err)
        except Exception:  # its message is enough
            pickled = None
        return cls(str(err), pickled, refused)

    def error(self) -> BaseException:
        if self.pickled is not None:
            try:
                return pickle.loads(self.pickled)
            except Exception:  # a class that does not rebuild from its args: its message stands
                pass
        return RuntimeError(self.message)


def computed_and_sent(
    computes: bool,
    compute: Callable[[], T],
    send: Callable[[bytes | Failure | None], R],
    sendable: Callable[[T], Any] = lambda result: result,
    refused: Callable[[Exception], bool] = lambda err: False,
) -> tuple[T | None, R]:
    """``compute()`` where ``computes``, then ``send`` (every process calls it) of the outcome: ``sendable`` of
    the result pickled, or the ``Failure`` its error becomes (``None`` on the other processes). Returns this
    process's result (``None`` where it did not compute) and what ``send`` returned; the computing process's
    error is raised after sending."""
    result: T | None = None
    own_error: Exception | None = None
    outcome: bytes | Failure | None = None
    if computes:
        try:
            result = compute()
            outcome = pickle.dumps(sendable(result))  # here: a result that does not pickle fails as compute() does
        except Exception as err:  # every error goes to the other processes, then is raised here
            own_error, outcome = err, Failure.of(err, refused(err))
    received = send(outcome)
    if own_error is not None:
        raise own_error
    return result, received
