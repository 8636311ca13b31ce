"""``once_per_node`` without several ranks runs the step here; a first process's error that does not pickle still
reaches the other ranks, by its message. (Two ranks: tests/data/test_tokenize_once_per_node.py.)"""

import threading

import pytest

from pl_lowprec.distributed.once_per_node import once_per_node
from pl_lowprec.distributed.sent_outcome import Failure


def test_without_a_process_group_the_step_runs_here():
    assert once_per_node(None, lambda: ("table.arrow", 3)) == ("table.arrow", 3)
    with pytest.raises(ValueError, match="bad record"):
        once_per_node(None, lambda: (_ for _ in ()).throw(ValueError("bad record")))


def test_an_error_is_raised_elsewhere_as_itself_or_by_its_message():
    copied = Failure.of(ValueError("row 3: no chat template")).error()
    assert type(copied) is ValueError and str(copied) == "row 3: no chat template"

    class Unpicklable(ValueError):
        lock = None

        def __reduce__(self):
            return (Unpicklable, (threading.Lock(),))

    copied = Failure.of(Unpicklable("disk full")).error()
    assert type(copied) is RuntimeError and str(copied) == "disk full"
