"""The ``"auto"`` settings' search, and ``memory_budget``'s estimate, on rank 0 alone, the outcome sent to the
other ranks.

Why: every rank must run the same settings, and each used to simulate the same candidates itself: seconds of
the same work per rank (a 2-rank run on one host paid them twice on shared cores, in every run with ``"auto"``
under DDP or FSDP). The memory limit is already the least of all ranks, so rank 0's search is the one every rank
would make; taking it also rules out ranks choosing apart on batches of other shapes. The configs stay out of
what is sent (a config may hold the user's callables, which do not pickle): each rank rebuilds them from the
settings, as the search built them. ``memory_budget``'s check (an estimate of the settings the run keeps, or
its refusal) is sent whole.
"""

from __future__ import annotations

import dataclasses
import pickle
from collections.abc import Callable
from typing import Any, TypeVar

from pl_lowprec.distributed.sent_outcome import Failure, computed_and_sent
from pl_lowprec.distributed.several_ranks import several_ranks
from pl_lowprec.memory.fastest import Search, settings_config
from pl_lowprec.transforms.config import TransformConfig
from pl_lowprec.transforms.pretrained_adapter import adapters_resolved_once

T = TypeVar("T")


class RefusedOnRankZero(ValueError):
    """A refusal rank 0 met (the transform's own, or ``memory_budget``'s): raised on the other ranks in its words."""


class SearchFailedOnRankZero(RuntimeError):
    """Rank 0's simulated step failed (not a refusal), in its words on the other ranks."""


def on_rank_zero(
    strategy: Any,
    compute: Callable[[], T],
    refused: Callable[[BaseException], bool],
    sendable: Callable[[T], Any] = lambda result: result,
    received: Callable[[Any], T] = lambda sent: sent,
) -> T:
    """``compute()`` on rank 0 and, under several processes, its result on every other rank (``sendable`` of it,
    pickled, then ``received``); an error of rank 0's is raised on every rank (``RefusedOnRankZero`` where
    ``refused`` says it was a refusal, else ``SearchFailedOnRankZero``), rank 0 raising its own."""
    if not several_ranks():
        return compute()
    zero = strategy.global_rank == 0
    result, sent = computed_and_sent(
        zero, compute, lambda outcome: strategy.broadcast(outcome, src=0), sendable, refused
    )
    if zero:
        return result  # type: ignore[return-value]
    if isinstance(sent, Failure):
        raise (RefusedOnRankZero if sent.refused else SearchFailedOnRankZero)(sent.message)
    return received(pickle.loads(sent))


def search_on_rank_zero(
    strategy: Any,
    search: Callable[[], Search],
    config: TransformConfig,
    refused: Callable[[BaseException], bool],
) -> Search:
    """``search()`` on rank 0, the same ``Search`` on every rank (``on_rank_zero``), sent without its configs."""

    def without_configs(found: Search) -> Search:
        return dataclasses.replace(found, tried=[(settings, None, e) for settings, _, e in found.tried])

    return on_rank_zero(strategy, search, refused, without_configs, lambda sent: with_configs(sent, config))


@adapters_resolved_once()  # each rebuilt config names the same pretrained_adapter: resolved once, as in the search
def with_configs(search: Search, config: TransformConfig) -> Search:
    """``search`` as sent (no configs) with each candidate's config rebuilt from ``config`` as the search did."""
    tried = [(chosen, settings_config(config, chosen, search.blocks), estimate) for chosen, _, estimate in search.tried]
    return dataclasses.replace(search, tried=tried)
