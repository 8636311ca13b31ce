"""A step that runs once per node, on the node's first process, whose result every process of the node gets.

Why: tokenizing a dataset into an Arrow table on every rank costs N times the time and the temporary disk for
the same rows. Once per node, not once overall: the table lives in the node's temporary directory (``datasets``'
own, deleted at exit), which the other nodes cannot read, and the nodes work at the same time, so once overall
would save no wall time. Lightning's default (``prepare_data_per_node=True``) and Hugging Face's
(``main_process_first(local=True)``) are the same.

Not Lightning's ``prepare_data``: its other ranks wait in a barrier with no timeout (``_InfiniteBarrier``), so a
first process that fails leaves them waiting for ever. Here they wait in an all-gather that carries every node's
outcome, errors included: a failure on any node is raised on every rank, the first process's own exception there
and a copy of it elsewhere. The wait has no timeout either (a large dataset tokenizes for longer than the process
group's 30 minutes); a process that dies instead closes its connections, which ends the others' wait.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

import torch.distributed as dist

from pl_lowprec.distributed.sent_outcome import Failure, computed_and_sent
from pl_lowprec.distributed.several_ranks import several_ranks

T = TypeVar("T")
NO_TIMEOUT = timedelta(days=10000)  # as Lightning's _InfiniteBarrier


def once_per_node(trainer: Any, compute: Callable[[], T]) -> T:
    """``compute()`` on the node's first process (``trainer.local_rank == 0``), its result (which must pickle) on
    every process of the node; its error, or another node's, raised on every process. Every process calls it.
    Without a process group of several ranks, or a trainer, ``compute()`` here."""
    if trainer is None or not several_ranks():
        return compute()
    _, gathered = computed_and_sent(
        trainer.local_rank == 0, compute, lambda outcome: _all_gather((trainer.node_rank, outcome))
    )
    failure = next((o for _, o in gathered if isinstance(o, Failure)), None)
    if failure is not None:  # another node's (the first process raised its own in computed_and_sent)
        raise failure.error()
    return pickle.loads(next(o for node, o in gathered if node == trainer.node_rank and o is not None))


def _all_gather(mine: Any) -> list[Any]:
    """Every rank's ``mine``, over a gloo group of its own with no timeout: CPU objects whatever the main group's
    backend, and a wait as long as the first process works."""
    group = dist.new_group(backend="gloo", timeout=NO_TIMEOUT)
    try:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine, group=group)
        return gathered
    finally:
        dist.destroy_process_group(group)
