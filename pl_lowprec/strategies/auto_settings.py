"""``"auto"`` memory settings in a strategy: before ``fit`` loads anything, the fastest settings whose predicted peak
fits this device (``pl_lowprec.memory.fastest``), said in one line.

The memory is ``memory_budget=`` where given (as given: it is what the peak may reach), else what the device has
free now less a 10% margin for what the estimate does not see (the caching allocator's fragmentation, kernels'
scratch, DDP's buckets): ``torch.cuda.mem_get_info`` on CUDA, the host's ``MemAvailable`` on CPU, shared by the
processes on the host. Every rank takes the least of all ranks, and rank 0 alone simulates the candidates and
sends its search to the others (``rank_zero_search.py``), so all of them run the same settings. The
estimate runs as ``memory_budget``'s does: on a meta copy of the module as ``configure_model`` left it, with one
batch of the run's own data drawn without touching its random state.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn

from pl_lowprec._error_text import briefly, raised_under
from pl_lowprec.distributed.several_ranks import several_ranks
from pl_lowprec.memory.collectives import Interconnect, gradient_as_bucket_view, measure_interconnect
from pl_lowprec.memory.fastest import MARGIN, Search, fastest_fitting
from pl_lowprec.memory.plan import fresh_copies
from pl_lowprec.memory.process import available_memory
from pl_lowprec.memory.sizes import format_bytes
from pl_lowprec.strategies.rank_zero_search import RefusedOnRankZero, search_on_rank_zero


def choose_memory_settings(
    strategy: Any,
    trainer: Any,
    batch: Any,
    precision: str,
    budget: int | None,
    interconnect: Interconnect | None = None,
) -> Search | None:
    """Resolve ``strategy.transform_config``'s ``"auto"`` settings for the device with one ``batch`` of the run's
    data (``first_training_batch``), log the choice once, and return the search (``None`` where the device's
    memory cannot be read: the ``"auto"`` settings then stay on their memory-saving side). The predicted step
    times its collectives on ``interconnect``, the run's own (``run_interconnect``)."""
    device = strategy.root_device
    limit, memory = memory_limit(strategy, device, budget)
    if limit is None:
        rank_zero_info(f"Memory settings: the free memory of {device} cannot be read here: memory-saving settings.")
        return None
    config = strategy.transform_config

    def simulate() -> Search:  # on rank 0 alone under several processes
        return fastest_fitting(
            fresh_copies(strategy.lightning_module),  # each call a meta copy: the estimate transforms its own
            batch,
            limit,
            precision,
            device,
            config,
            accumulate_grad_batches=int(trainer.accumulate_grad_batches),
            sharding=strategy.transform.sharding,
            world_size=strategy.world_size,
            gradient_as_bucket_view=gradient_as_bucket_view(strategy),
        )

    try:
        search = search_on_rank_zero(strategy, simulate, config, refused_by_the_transform)
    except Exception as err:  # the real run meets it again where it has its own handling (a refusal, a traceback)
        if refused_by_the_transform(err) or isinstance(err, RefusedOnRankZero):
            raise  # the transform's own refusal (a group size, a layer float8 cannot take): said once, as it is
        rank_zero_warn(
            f"Memory settings: the simulated step failed ({briefly(err, 300)}), so"
            " the 'auto' settings stay on their memory-saving side. Set memory_saving and activation_checkpointing"
            " explicitly to run without the simulation."
        )
        return None
    for _, _, estimate in search.tried:
        estimate.interconnect = interconnect
    line = search.line(memory)
    if search.fits:
        rank_zero_info(line)
    elif budget is None:  # above a budget, memory_budget's check refuses the run next, in one paragraph
        rank_zero_warn(
            f"{line} Training with them anyway, as without 'auto': the prediction may be above what this run takes"
            " (other processes may free memory), or it will run out of memory. `pl-lowprec plan --config YOUR.yaml"
            " --memory SIZE` says what would fit; memory_budget= stops such a run before it loads."
        )
    strategy.transform_config = strategy.transform.config = search.config
    return search


def run_interconnect(strategy: Any) -> Interconnect | None:
    """How fast this run's ranks exchange tensors, measured on its process group (every rank calls it);
    ``None`` on one process."""
    if not several_ranks():
        return None
    return measure_interconnect(strategy.root_device)


def memory_limit(strategy: Any, device: torch.device, budget: int | None) -> tuple[int | None, str]:
    """The bytes a predicted peak may reach, and where they come from, in words."""
    if budget is not None:
        return budget, f"memory_budget={format_bytes(budget)}"
    free = available_memory(device)
    if free is None:
        return None, ""
    least = strategy.reduce(torch.tensor(free, dtype=torch.int64, device=device), reduce_op="min")
    free = int(least)
    where = f"free on {device}" if device.type == "cuda" else "of available host memory"
    where += ", the least of all ranks" if strategy.world_size > 1 else ""
    local = len(strategy.parallel_devices or [device])
    shared = device.type == "cpu" and local > 1  # the processes on one host share its memory
    where += f", shared by {local} processes" if shared else ""
    limit = free / (local if shared else 1) * (1 - MARGIN)
    return int(limit), f"{format_bytes(free)} {where}, less {MARGIN:.0%}"


def refused_by_the_transform(err: BaseException) -> bool:
    """Whether the simulated step stopped at a refusal of the model transform (``pl_lowprec/transforms``), which
    the real run would meet in the same words right after: it came twice, first inside a warning."""
    return isinstance(err, ValueError) and raised_under(err, "pl_lowprec", "transforms")
