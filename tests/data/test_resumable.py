"""ResumableDataLoader: the state is (epoch, batches consumed); a changed setup refuses to resume."""

import pytest
import torch

from pl_lowprec.data import resumable_loader


def _loader(batch_size=3, seed=0):
    return resumable_loader(list(range(20)), batch_size, torch.tensor, trainer=None, seed=seed)


def test_resumed_epoch_continues_with_the_next_unconsumed_batch():
    loader = _loader()
    loader.sampler.set_epoch(2)
    full = [b.tolist() for b in loader]
    resumed = _loader()
    resumed.load_state_dict({**loader.state_dict(), "epoch": 2, "batches": 4})
    resumed.sampler.set_epoch(2)  # what Lightning does at the start of the restored epoch
    assert [b.tolist() for b in resumed] == full[4:]
    assert [b.tolist() for b in resumed] == full  # the skip applies to the restored epoch only once


def test_other_epoch_is_not_skipped():
    loader = _loader()
    loader.load_state_dict({**loader.state_dict(), "epoch": 1, "batches": 4})
    loader.sampler.set_epoch(2)
    assert len(list(loader)) == 7


def test_changed_batch_size_or_seed_refuses_to_resume():
    state = _loader().state_dict()
    with pytest.raises(ValueError, match=r"batch_size: 3 in the checkpoint, 4 now, seed: 0 in the checkpoint, 1 now"):
        _loader(batch_size=4, seed=1).load_state_dict(state)


def test_shards_by_data_parallel_replica_not_by_process():
    """Under tensor parallelism (Lightning's ModelParallelStrategy, data_parallel_size=1, tensor_parallel_size=2)
    both processes train one replica: they were given different halves of the data, as if two replicas."""
    from types import SimpleNamespace

    one_replica = [
        SimpleNamespace(world_size=2, global_rank=rank, distributed_sampler_kwargs={"num_replicas": 1, "rank": 0})
        for rank in (0, 1)
    ]
    batches = [
        [b.tolist() for b in resumable_loader(list(range(20)), 4, torch.tensor, trainer)] for trainer in one_replica
    ]
    assert batches[0] == batches[1] and sorted(i for batch in batches[0] for i in batch) == list(range(20))
    two_replicas = [SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 2, "rank": rank}) for rank in (0, 1)]
    halves = [
        [i for b in resumable_loader(list(range(20)), 4, torch.tensor, t) for i in b.tolist()] for t in two_replicas
    ]
    assert sorted(halves[0] + halves[1]) == list(range(20))
    single = SimpleNamespace(world_size=1, global_rank=0, distributed_sampler_kwargs=None)  # not a ParallelStrategy
    assert len(list(resumable_loader(list(range(20)), 4, torch.tensor, single))) == 5
