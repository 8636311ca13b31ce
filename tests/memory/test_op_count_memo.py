"""The op counter's per-call work, done once per call label: each block of a simulated step repeats the same calls,
and the counting runs at every op of every estimate a plan search makes. The figures stay those of counting each
call afresh."""

import pytest
import torch

from pl_lowprec.memory import kernel_replay, op_counts
from pl_lowprec.memory.op_counts import CountingMode


@pytest.fixture
def formulas_run(monkeypatch):
    """The calls whose FLOP formula ran (each CountingMode counts with its own memo)."""
    ran: list[str] = []
    real = op_counts._flops

    def counted(func, args, kwargs, out):
        ran.append(str(func))
        return real(func, args, kwargs, out)

    monkeypatch.setattr(op_counts, "_flops", counted)
    return ran


def test_a_repeated_call_runs_its_flop_formula_once_and_counts_the_same_flops(formulas_run):
    a, b, c = torch.ones(8, 16), torch.ones(16, 4), torch.ones(16, 32)
    with CountingMode() as mode:
        a @ b  # a call
        a @ b  # the same call again: the formula's FLOPs reused
        a @ c  # another shape: its own formula run
    assert formulas_run.count("aten.mm.default") == 2
    mm = {key: n for key, n in mode.counter.profile.counts.items() if "aten.mm" in key[4]}
    assert sorted((key[1], n) for key, n in mm.items()) == [(2 * 8 * 16 * 4, 2), (2 * 8 * 16 * 32, 1)]


def test_a_call_without_a_label_runs_its_formula_each_time(formulas_run):
    parts = [torch.ones(2, 3), torch.ones(2, 3)]
    with CountingMode():
        torch.cat(parts)  # a list of tensors: no label, nothing to key a memo on
        torch.cat(parts)
    assert formulas_run.count("aten.cat.default") == 2


def test_a_number_that_does_not_read_back_gives_no_label():
    assert kernel_replay._argument(float("inf")) is None  # inf does not come back from its repr
    assert kernel_replay._argument(float("inf")) is None  # nor from the memo of that answer
    assert kernel_replay._argument(2.5) == "2.5"
