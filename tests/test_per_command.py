"""The one per-command scope (``pl_lowprec/_per_command.py``) behind the config parses, the resolved adapters and
the open weight files: made by the outermost scope, shared by the nested ones, closed once, gone after."""

from pl_lowprec._per_command import PerCommand


def test_the_outermost_scope_makes_the_value_the_nested_ones_share_and_closes_it_once():
    closed = []
    values = PerCommand("test_values", object, closed.append)
    assert values.current() is None
    with values.scope() as outer:
        with values.scope() as inner:
            assert inner is outer is values.current()
        assert closed == []  # a nested scope leaves the value open
    assert closed == [outer]
    assert values.current() is None
    with values.scope() as again:
        assert again is not outer  # each command starts without the last one's value


def test_an_empty_value_is_shared_too_and_the_scope_decorates():
    """A cache starts empty (falsy): the nested scope must still take it, not make its own."""
    caches = PerCommand("test_caches", dict)

    @caches.scope()
    def fill(key: str) -> dict:
        caches.current()[key] = True
        return caches.current()

    with caches.scope() as cache:
        assert fill("a") is cache
        assert cache == {"a": True}
    assert fill("b") == {"b": True}  # alone, a fresh cache for the call
    assert caches.current() is None
