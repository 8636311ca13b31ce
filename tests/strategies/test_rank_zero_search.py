"""Under several processes, rank 0 alone simulates the ``"auto"`` candidates and the other ranks take its search
(``strategies/rank_zero_search.py``): the same settings, configs, estimates and line as a rank's own search, and
rank 0's errors raised on every rank instead of leaving them waiting. Two ranks are played in one process, the
broadcast carried through pickle as ``broadcast_object_list`` carries it."""

import pickle
import threading
from types import SimpleNamespace

import pytest
import torch
from qlora_helpers import ids_loader, tiny_llama

import pl_lowprec.strategies.auto_settings as auto_settings
import pl_lowprec.strategies.rank_zero_search as rank_zero_search
from pl_lowprec.transforms.config import TransformConfig

pytest.importorskip("peft")
AUTO = TransformConfig(lora={"r": 4}, memory_saving="auto", activation_checkpointing="auto")
BATCH = next(iter(ids_loader(batches=1, batch_size=4, seq_len=64)))
BUDGET = int(2.4 * 2**20)  # below the fastest candidate's 2.61 MiB per rank (rank of 2)


class _Rank:
    """What ``choose_memory_settings`` reads from a strategy, as rank ``rank`` of 2; ``broadcast`` sends rank 0's
    object (pickled, as torch does) through ``wire``."""

    def __init__(self, rank: int, wire: list, model: torch.nn.Module):
        self.global_rank, self.world_size, self.wire = rank, 2, wire
        self.root_device = torch.device("cpu")
        self.parallel_devices = [self.root_device] * 2
        self.lightning_module = model
        self.transform_config = AUTO
        self.transform = SimpleNamespace(sharding=None, config=AUTO)

    def broadcast(self, obj, src=0):
        assert src == 0
        if self.global_rank == 0:
            self.wire.append(pickle.dumps(obj))
        return pickle.loads(self.wire[-1])


def _choose(strategy, budget):
    trainer = SimpleNamespace(accumulate_grad_batches=1)
    return auto_settings.choose_memory_settings(strategy, trainer, BATCH, "bf16-mixed", budget)


def _described(search):
    return [(s, c, e.peak, e.timeline) for s, c, e in search.tried], search.config


def test_rank_one_takes_rank_zeros_search_and_holds_what_its_own_would_give(monkeypatch):
    torch.manual_seed(0)
    model = tiny_llama(hidden_size=64)
    alone = _choose(_Rank(0, [], model), BUDGET)  # one process: its own search
    assert len(alone.tried) > 1  # the budget makes the search pass over faster candidates
    monkeypatch.setattr(rank_zero_search, "several_ranks", lambda: True)
    calls = []
    simulate = auto_settings.fastest_fitting
    monkeypatch.setattr(auto_settings, "fastest_fitting", lambda *a, **k: calls.append(1) or simulate(*a, **k))
    wire = []
    zero = _choose(_Rank(0, wire, model), BUDGET)
    one = _choose(_Rank(1, wire, model), BUDGET)
    assert len(calls) == 1  # rank 0 simulated; rank 1 only rebuilt the configs
    assert _described(one) == _described(zero) == _described(alone)
    assert one.line("memory") == zero.line("memory")  # the step time too (measured rates may vary between runs)
    assert one.config.activation_checkpointing == alone.config.activation_checkpointing != "auto"


@pytest.mark.parametrize("refusal", [True, False])
def test_rank_zeros_error_is_raised_on_every_rank(monkeypatch, refusal):
    """A refusal of the transform is raised on every rank in its words; any other failure keeps every rank on the
    memory-saving side (``None``), as one process does."""
    monkeypatch.setattr(rank_zero_search, "several_ranks", lambda: True)

    def fails(*args, **kwargs):
        raise ValueError("lora r=4: refused") if refusal else RuntimeError("the simulated step broke")

    monkeypatch.setattr(auto_settings, "fastest_fitting", fails)
    monkeypatch.setattr(auto_settings, "refused_by_the_transform", lambda err: refusal and "refused" in str(err))
    wire, model = [], tiny_llama(hidden_size=64)
    if refusal:
        with pytest.raises(ValueError, match="lora r=4: refused"):
            _choose(_Rank(0, wire, model), BUDGET)
        with pytest.raises(rank_zero_search.RefusedOnRankZero, match="lora r=4: refused"):
            _choose(_Rank(1, wire, model), BUDGET)
    else:
        with pytest.warns(UserWarning, match="the simulated step failed .*the simulated step broke"):
            assert _choose(_Rank(0, wire, model), BUDGET) is None
            assert _choose(_Rank(1, wire, model), BUDGET) is None  # said on rank 0 alone in a real run
    assert len(wire) == 1  # rank 0 sent before raising: the others are not left waiting in the broadcast


def test_the_budget_check_is_made_once_and_its_refusal_raised_on_every_rank(monkeypatch):
    """``memory_budget``'s check (``transform_hooks.settle_memory``) through ``on_rank_zero``: rank 1 holds rank
    0's estimate without simulating, and a refusal reaches it in the same words."""
    import functools

    import pl_lowprec.memory.budget as budget
    from pl_lowprec.strategies.transform_hooks import is_budget_refusal

    monkeypatch.setattr(rank_zero_search, "several_ranks", lambda: True)
    calls = []
    simulate = budget.estimate_memory
    monkeypatch.setattr(budget, "estimate_memory", lambda *a, **k: calls.append(1) or simulate(*a, **k))
    # The refusal's own plan (about 20 more simulations, 90% of this test; tests/memory/test_budget.py checks it)
    # is taken as made: what is checked here is that rank 1 gets rank 0's words without simulating.
    monkeypatch.setattr(budget, "_suggestion", lambda *a: "The plan for this budget: (rank 0's search).")
    model = tiny_llama(hidden_size=64)

    def on_rank(rank, wire, limit):
        check = functools.partial(budget.check_memory_budget, limit, model, BATCH, 1, "bf16-mixed", "cpu", AUTO)
        return rank_zero_search.on_rank_zero(_Rank(rank, wire, model), check, is_budget_refusal)

    wire = []
    zero, one = on_rank(0, wire, 2**30), on_rank(1, wire, 2**30)
    assert len(calls) == 1 and (one.peak, one.timeline, one.ops) == (zero.peak, zero.timeline, zero.ops)
    wire = []
    with pytest.raises(ValueError, match=r"memory_budget=1\.00 MiB: the predicted peak") as on_zero:
        on_rank(0, wire, 2**20)
    with pytest.raises(rank_zero_search.RefusedOnRankZero) as on_one:
        on_rank(1, wire, 2**20)
    assert str(on_one.value) == str(on_zero.value)


def test_a_result_that_does_not_pickle_reaches_the_other_ranks_as_rank_zeros_failure(monkeypatch):
    """Pickled with the step, not in the broadcast: rank 0 raising while pickling would leave the others waiting."""
    monkeypatch.setattr(rank_zero_search, "several_ranks", lambda: True)
    wire, model = [], tiny_llama(hidden_size=64)

    def on_rank(rank):
        return rank_zero_search.on_rank_zero(_Rank(rank, wire, model), threading.Lock, lambda err: False)

    with pytest.raises(TypeError, match="cannot pickle"):
        on_rank(0)
    assert len(wire) == 1  # sent before raising
    with pytest.raises(rank_zero_search.SearchFailedOnRankZero, match="cannot pickle"):
        on_rank(1)
