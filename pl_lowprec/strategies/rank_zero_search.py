"""The ``"auto"`` settings' search on rank 0 alone, its outcome sent to the other ranks.

Why: every rank must run the same settings, and each used to simulate the same candidates itself: seconds of
the same work per rank (a 2-rank run on one host paid them twice on shared cores, in every run with ``"auto"``
under DDP or FSDP). The memory limit is already the least of all ranks, so rank 0's search is the one every rank
would make; taking it also rules out ranks choosing apart on batches of other shapes. The configs stay out of
what is sent (a config may hold the user's callables, which do not pickle): each rank rebuilds them from the
settings, as the search built them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from pl_lowprec.memory.fastest import Search, settings_config
from pl_lowprec.transforms.config import TransformConfig
from pl_lowprec.transforms.pretrained_adapter import adapters_resolved_once


class RefusedOnRankZero(ValueError):
    """The transform's own refusal, met by rank 0's simulated step: raised on the other ranks in its words."""


class SearchFailedOnRankZero(RuntimeError):
    """Rank 0's simulated step failed (not a refusal): every rank keeps the memory-saving side."""


def search_on_rank_zero(
    strategy: Any,
    search: Callable[[], Search],
    config: TransformConfig,
    refused: Callable[[BaseException], bool],
) -> Search:
    """``search()`` on rank 0 and, under several processes, the same ``Search`` on every other rank; an error
    of rank 0's is raised on every rank (``RefusedOnRankZero`` where ``refused`` says it was the transform's own
    refusal, else ``SearchFailedOnRankZero``), rank 0 raising its own."""
    if strategy.world_size <= 1 or not torch.distributed.is_initialized():
        return search()
    found: Search | None = None
    error: Exception | None = None
    sent: tuple[str, Any] | None = None
    if strategy.global_rank == 0:
        try:
            found = search()
            sent = ("search", dataclasses.replace(found, tried=[(s, None, e) for s, _, e in found.tried]))
        except Exception as err:  # sent before raising: the other ranks wait in the broadcast
            error = err
            sent = ("refused" if refused(err) else "failed", str(err))
    kind, payload = strategy.broadcast(sent, src=0)
    if error is not None:
        raise error
    if found is not None:
        return found
    if kind == "refused":
        raise RefusedOnRankZero(payload)
    if kind == "failed":
        raise SearchFailedOnRankZero(payload)
    return with_configs(payload, config)


@adapters_resolved_once()  # each rebuilt config names the same pretrained_adapter: resolved once, as in the search
def with_configs(search: Search, config: TransformConfig) -> Search:
    """``search`` as sent (no configs) with each candidate's config rebuilt from ``config`` as the search did."""
    tried = [(chosen, settings_config(config, chosen, search.blocks), estimate) for chosen, _, estimate in search.tried]
    return dataclasses.replace(search, tried=tried)
