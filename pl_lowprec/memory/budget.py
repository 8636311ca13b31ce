"""``memory_budget=``: the strategy predicts the step's peak before any weight is loaded, and refuses a run that
would not fit, naming what ``plan_memory`` would change.

Lightning's ``BatchSizeFinder`` and Hugging Face's ``auto_find_batch_size`` find out by running out of memory;
this asks ``estimate_memory`` instead (one fake step through the strategy's own transform, seconds), on a meta
copy of the module as ``configure_model`` left it and one batch of the run's own training data, with the
Trainer's precision, accumulation and device, and under ``lowprec_fsdp`` per rank. The budget is what the peak may
reach: keep a margin inside it for what the estimate does not see (the CUDA context, the caching allocator's
fragmentation, DDP's gradient buckets).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from pl_lowprec.memory.estimate import MemoryEstimate, estimate_memory
from pl_lowprec.memory.fake_step import batch_tensors
from pl_lowprec.memory.plan import Simulated, fresh_copies, plan_memory, resized
from pl_lowprec.memory.quiet import quiet_setup_logs
from pl_lowprec.memory.sizes import format_bytes
from pl_lowprec.transforms.checkpointing import declared_blocks
from pl_lowprec.transforms.config import TransformConfig


def training_loader(trainer: Any) -> Any:
    """The run's training loader, asked of its model or datamodule as Lightning's fit loop asks, without moving
    any random state the run will use."""
    with torch.random.fork_rng(devices=[]):
        return trainer.fit_loop._data_source.dataloader()


def first_training_batch(loader: Any) -> Any:
    """One batch of ``loader`` (``training_loader``), drawn without moving any random state the run will use."""
    with torch.random.fork_rng(devices=[]):
        return next(iter(loader))


def check_memory_budget(
    budget: int,
    module: nn.Module,
    batch: Any,
    accumulate: int,
    precision: str,
    device: torch.device,
    config: TransformConfig,
    sharding: Any = None,
    world_size: int = 1,
    estimate: MemoryEstimate | None = None,
    gradient_as_bucket_view: bool = False,
    simulated: Sequence[tuple[TransformConfig, MemoryEstimate]] = (),
) -> MemoryEstimate:
    """Predict the peak of one optimizer step of ``batch`` (``first_training_batch``), ``accumulate`` micro-batches
    each, or take ``estimate``, made for ``config`` already; ``ValueError`` naming the plan's settings when it exceeds
    ``budget``. ``simulated``: other configs' estimates for the same batch and accumulation (the automatic choice's
    candidates), which the plan of the refusal takes instead of simulating them again."""
    build = fresh_copies(module)  # each call a meta copy: the estimate transforms its own, the module stays
    if estimate is None:
        with quiet_setup_logs():  # the run prints its setup lines itself, once, when it loads
            estimate = estimate_memory(
                build,
                batch,
                precision=precision,
                device=device,
                config=config,
                accumulate_grad_batches=accumulate,
                sharding=sharding,
                world_size=world_size,
                gradient_as_bucket_view=gradient_as_bucket_view,
            )
        simulated = [*simulated, (config, estimate)]  # the plan's candidate with no change, where it has one
    per = " per rank" if sharding is not None else ""
    if estimate.peak <= budget:
        rank_zero_info(
            f"memory_budget={format_bytes(budget)}: the predicted peak{per} is {format_bytes(estimate.peak)}"
            f" ({estimate.peak_phase}), {format_bytes(budget - estimate.peak)} of headroom"
            f" (estimated in {estimate.seconds:.1f} s)."
        )
        return estimate
    split = sorted(((k, v) for k, v in estimate.peak_split.items() if v), key=lambda kv: -kv[1])[:3]
    ranks = (sharding, world_size, gradient_as_bucket_view)
    parts = ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in split)
    raise ValueError(
        f"memory_budget={format_bytes(budget)}: the predicted peak of this run is {format_bytes(estimate.peak)}{per}"
        f" (during the {estimate.peak_phase}; {parts}), above the budget, so it was stopped before loading any"
        f" weight. {_suggestion(budget, build, batch, accumulate, precision, device, config, ranks, simulated)}"
        " `pl-lowprec plan --config YOUR.yaml --memory BUDGET --out plan.yaml` writes such settings as a config;"
        " or raise memory_budget if the device has more memory."
    )


def _suggestion(
    budget: int,
    build: Callable[[], nn.Module],
    batch: Any,
    accumulate: int,
    precision: str,
    device: torch.device,
    config: TransformConfig,
    ranks: tuple[Any, int, bool],
    simulated: Sequence[tuple[TransformConfig, MemoryEstimate]],
) -> str:
    """What ``plan_memory`` chooses for the same global batch, or why nothing fits; ``ranks``: the sharding, the
    number of ranks and DDP's ``gradient_as_bucket_view``; ``simulated`` as ``check_memory_budget`` takes it."""
    sharding, world_size, gradient_as_bucket_view = ranks
    rows = next(t.shape[0] for t in batch_tensors(batch))
    plan = plan_memory(
        build,
        lambda micro: resized(batch, micro),
        budget,
        rows * accumulate * world_size,
        precision,
        device,
        config,
        devices=world_size,
        margin=0.0,
        block_names=declared_blocks(build()),
        sharding=sharding,
        gradient_as_bucket_view=gradient_as_bucket_view,
        simulated=[Simulated(done, rows, accumulate, estimate) for done, estimate in simulated],
    )
    chosen = plan.chosen
    if chosen is None:
        return plan.nothing_fits()
    return (
        f"The plan for this budget and the same global batch: {chosen.settings.describe()} (predicted"
        f" {format_bytes(chosen.peak)})."
    )
