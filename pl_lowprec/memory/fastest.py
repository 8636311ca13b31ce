"""The fastest settings whose predicted peak fits: what ``memory_saving="auto"`` and
``activation_checkpointing="auto"`` choose before ``fit`` loads anything.

The candidates run from the fastest to the most memory-saving; each is one ``estimate_memory`` (a fake step through
the strategy's own transform), and the first that fits is taken, so a device with room costs one estimate:

1. nothing traded for memory: no activation checkpointing, peft's MLP, the norms' own backward,
   ``F.cross_entropy`` on fp32 logits over every position at once (Hugging Face's recipe, without its
   checkpointing);
2. the module's loss without fp32 logits: cross-entropy in row groups and, with
   ``CausalLM(loss_chunk_size="auto")``, in chunks of 256 positions (at a 128k vocabulary the logits are a step's
   largest temporaries, and this costs little time);
3. every exact path: also the fused LoRA MLP and the norms recomputed row-wise;
4. with them, activation checkpointing: selective, every 2nd block, every block (the shipped memory-saving
   settings).

A setting given explicitly is the same in every candidate, and candidates that differ only in paths that do not
apply to the run (no LoRA under mixed precision: no fused MLP, no recomputed norms) are simulated once; with
``checkpoint_impl="reentrant"`` selective is left out, and the line says so. ``predicted_seconds`` orders them.
``plan_memory`` (``pl-lowprec plan``) searches these same candidates (``ladder``), at each micro-batch.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pl_lowprec.distributed.sharding import Sharding
from pl_lowprec.memory.estimate import MemoryEstimate, estimate_memory, resolved_precision
from pl_lowprec.memory.fake_step import DryRunTrainer, attached
from pl_lowprec.memory.quiet import quiet_setup_logs
from pl_lowprec.memory.sizes import format_bytes, format_bytes_at_least
from pl_lowprec.transforms.checkpointing import declared_blocks
from pl_lowprec.transforms.config import TransformConfig
from pl_lowprec.transforms.dtypes import dtype_of_precision
from pl_lowprec.transforms.memory_saving import ALL_PATHS, AUTO, PATHS
from pl_lowprec.transforms.pretrained_adapter import adapters_resolved_once

MARGIN = 0.1  # of the free memory, kept for what the estimate does not see: the allocator's fragmentation, scratch
GIVEN = "as given"  # activation checkpointing set explicitly: the same in every candidate
LOSS_PATHS = frozenset({"grouped_cross_entropy", "chunked_loss"})
BLOCK_PATHS = frozenset({"fused_mlp", "recomputed_norms"})  # the strategy's own, with LoRA under mixed precision
LADDER: tuple[tuple[str, frozenset[str]], ...] = (
    ("none", frozenset()),
    ("none", LOSS_PATHS),
    ("none", ALL_PATHS),
    ("selective", ALL_PATHS),
    ("every 2nd block", ALL_PATHS),
    ("every block", ALL_PATHS),
)
# An ordering, not a prediction, until the step-time prediction replaces it: a step's time relative to the fastest
# settings. Checkpointing: measured on a 4-layer LoRA Llama on a CPU (docs/benchmarks.md, selective checkpointing).
# The paths: their share of a profiled 1B QLoRA step on an H200 (issue 28: fused MLP, norms, cross-entropy), the
# chunks one more output-head matmul per chunk.
CHECKPOINTING_TIME = {"none": 1.0, GIVEN: 1.0, "selective": 1.16, "every 2nd block": 1.18, "every block": 1.38}
PATH_TIME = {"fused_mlp": 0.05, "recomputed_norms": 0.03, "grouped_cross_entropy": 0.03, "chunked_loss": 0.02}
CHECKPOINTING_WORDS = {
    "none": "no activation checkpointing",
    "selective": "selective activation checkpointing",
    "every 2nd block": "activation checkpointing on every 2nd block",
    "every block": "activation checkpointing on every block",
}
PATH_WORDS = {  # (off, on)
    "fused_mlp": ("MLP unfused", "fused LoRA MLP"),
    "recomputed_norms": ("norms with their own backward", "norms recomputed row-wise"),
    "grouped_cross_entropy": ("cross-entropy on fp32 logits", "cross-entropy in row groups"),
    "chunked_loss": ("loss over all positions at once", "loss in chunks"),
}


@dataclass(frozen=True)
class MemorySettings:
    """One candidate: its activation checkpointing and the memory-saving paths on, of those that apply."""

    checkpointing: str  # a CHECKPOINTING_WORDS key, or GIVEN
    paths: frozenset[str]
    applicable: frozenset[str] = field(default=ALL_PATHS, compare=False)
    paths_given: bool = field(default=False, compare=False)  # memory_saving set explicitly: kept, not chosen

    def describe(self) -> str:
        return ", ".join(self.checkpointing_words() + self.path_words()) or "the settings as given"

    def checkpointing_words(self) -> list[str]:
        return [] if self.checkpointing == GIVEN else [CHECKPOINTING_WORDS[self.checkpointing]]

    def path_words(self) -> list[str]:
        """Each path that applies to the run, on or off, in words."""
        return [PATH_WORDS[p][p in self.paths] for p in PATHS if p in self.applicable]

    def chosen_words(self) -> list[str]:
        """What the search chose (the settings given as ``"auto"``), in words."""
        return self.checkpointing_words() + ([] if self.paths_given else self.path_words())

    def pinned_words(self) -> list[str]:
        """The memory-saving paths as the config gives them (``memory_saving`` not ``"auto"``), in words."""
        return self.path_words() if self.paths_given else []


def predicted_seconds(estimate: MemoryEstimate | None, settings: MemorySettings) -> float:
    """The ranking of candidates, fastest first: for now an explicit ordering (a step's time relative to the
    fastest settings, ``estimate`` unused), so candidates are ordered before any is simulated. The step-time
    prediction replaces it with the seconds per optimizer step of ``estimate``, the settings' simulated step."""
    return CHECKPOINTING_TIME[settings.checkpointing] + sum(PATH_TIME[p] for p in settings.paths)


def applicable_paths(config: TransformConfig, precision: str, model: nn.Module) -> frozenset[str]:
    """The memory-saving paths that change this run: the strategy's with LoRA under mixed precision and without
    ``compile=`` (``ModelTransform.apply``), and those the module's loss names (``memory_saving_paths``)."""
    paths = set(getattr(model, "memory_saving_paths", ()))
    if dtype_of_precision(precision) == torch.float32:
        paths.discard("grouped_cross_entropy")  # fp32 logits: it is F.cross_entropy itself (cross_entropy.py)
    if config.lora_in_compute_dtype(precision.endswith("-mixed")) and config.compile_kwargs is None:
        paths |= BLOCK_PATHS
    return frozenset(paths)


def candidates(config: TransformConfig, applicable: frozenset[str], blocks: list[str]) -> list[MemorySettings]:
    """The ladder's rungs with the explicit settings kept, each simulated-distinct one once, fastest first."""
    found: list[MemorySettings] = []
    for checkpointing, paths in LADDER:
        if config.activation_checkpointing != AUTO:
            checkpointing = GIVEN
        elif checkpointing != "none" and not blocks:
            continue  # the model declares no blocks to checkpoint
        elif checkpointing == "selective" and leaves_selective_out(config, blocks):
            continue
        selective = checkpointing == "selective" or (checkpointing == GIVEN and config.checkpoint_mode == "selective")
        here = applicable - {"fused_mlp"} if selective else applicable  # ModelTransform.apply: not fused there
        given = config.memory_saving != AUTO
        settings = MemorySettings(checkpointing, (config.memory_saving if given else paths) & here, here, given)
        if settings not in found:
            found.append(settings)
    return sorted(found, key=lambda s: predicted_seconds(None, s))


def leaves_selective_out(config: TransformConfig, blocks: list[str]) -> bool:
    """Whether ``"auto"`` checkpointing goes without its selective candidate: the model declares ``blocks`` to
    checkpoint, selective runs non-reentrant only (``checkpointing.py``), and the user chose
    ``checkpoint_impl="reentrant"``."""
    return bool(blocks) and config.activation_checkpointing == AUTO and config.checkpoint_impl == "reentrant"


SELECTIVE_LEFT_OUT = "selective checkpointing left out"
SELECTIVE_WHY = "it runs non-reentrant only, and checkpoint_impl is reentrant"


def settings_config(config: TransformConfig, settings: MemorySettings, blocks: list[str]) -> TransformConfig:
    """``config`` with the candidate's settings in place of its ``"auto"`` ones."""
    changes: dict[str, Any] = {}
    if config.memory_saving == AUTO:
        changes["memory_saving"] = settings.paths
    if config.activation_checkpointing == AUTO:
        if settings.checkpointing == "none":
            changes["activation_checkpointing"] = None
        else:
            changes["activation_checkpointing"] = list(blocks)
            changes["checkpoint_every_n"] = 2 if settings.checkpointing == "every 2nd block" else 1
            changes["checkpoint_mode"] = "selective" if settings.checkpointing == "selective" else "full"
    return dataclasses.replace(config, **changes)


def nothing_traded(config: TransformConfig) -> TransformConfig:
    """``config`` with its ``"auto"`` settings on the ladder's first rung, for a run that does not train
    (``export``, ``generate``): without a backward pass the memory-saving paths and checkpointing save nothing."""
    if not config.chooses_automatically:
        return config
    return settings_config(config, MemorySettings(*LADDER[0]), blocks=[])


@dataclass
class Search:
    """The candidates simulated, fastest first, up to the first that fits (all of them when none does)."""

    limit: int
    candidates: int = 0
    tried: list[tuple[MemorySettings, TransformConfig, MemoryEstimate]] = field(default_factory=list)
    left_out: str = ""  # a candidate the user's own setting rules out, and why: said where it would have come
    blocks: list[str] = field(default_factory=list)  # the blocks "auto" checkpoints (``ladder``'s)

    @property
    def fits(self) -> bool:
        return bool(self.tried) and self.tried[-1][2].peak <= self.limit

    @property
    def settings(self) -> MemorySettings:
        return self.tried[-1][0]

    @property
    def config(self) -> TransformConfig:
        return self.tried[-1][1]

    @property
    def estimate(self) -> MemoryEstimate:
        return self.tried[-1][2]

    def line(self, memory: str) -> str:
        """What was chosen for ``memory`` (e.g. "79.21 GiB free on cuda:0, less 10%"), its predicted peak, and
        what it gave up: the faster candidate before it and that one's peak."""
        step_time = getattr(self.estimate, "step_time", None)
        per_rank = " per rank" if self.estimate.world_size > 1 else ""
        predicted = f"predicted peak {format_bytes(self.estimate.peak)}{per_rank}"
        predicted += f", {step_time.seconds:.2f} s per step on {step_time.device}" if step_time else ""
        if not self.fits:
            return (
                f"No settings fit in {format_bytes(self.limit)} ({memory}): the most memory-saving"
                f" ({self.settings.describe()}) has a {predicted}{self._left_out()}."
            )
        if len(self.tried) == 1:
            gave_up = "the fastest settings: nothing is traded for memory"
        else:
            faster, _, estimate = self.tried[-2]
            gave_up = f"faster settings would need {format_bytes(estimate.peak)} ({faster.describe()})"
        chosen = self.settings.describe()
        line = f"Memory settings for {format_bytes(self.limit)} ({memory}): {chosen}; {predicted}; {gave_up}"
        return line + self._left_out() + "." + (COMPILED_CAVEAT if self.config.compile_kwargs is not None else "")

    def _left_out(self) -> str:
        """The clause on a candidate left out, once the search reached the checkpointing it would have been among."""
        reached = any(settings.checkpointing not in ("none", GIVEN) for settings, _, _ in self.tried)
        return f"; {self.left_out}" if self.left_out and reached else ""


# What the prediction under compile= adds and how well it held: compiled_backward.py.
COMPILED_CAVEAT = (
    " With compile=, checkpointed blocks' compiled backward is added to the eager prediction as measured on GPUs"
    " (within 1% at Llama-3.2-1B and -3.1-8B on an H100, +6.6% on held-out Qwen2.5-0.5B shapes on an H200);"
    " blocks compiled without checkpointing are predicted as eager ones, and CausalLM's loss over all positions at"
    " once as its compiled form holds it (8.26 GiB against 8.24 measured at Llama-3.2-1B without checkpointing)."
)


def ladder(
    build_model: Callable[[], nn.Module],
    precision: str,
    device: torch.device,
    config: TransformConfig,
    blocks: list[str] | None = None,
) -> tuple[list[MemorySettings], list[str]]:
    """The candidates for ``config`` on the module ``build_model`` builds, fastest first, and the blocks
    ``activation_checkpointing="auto"`` checkpoints: ``blocks`` where the caller names them (``plan_memory``'s
    ``block_names``), else those the module declares."""
    precision = resolved_precision(precision, device)  # Lightning's aliases ("bf16" is "bf16-mixed"), and "auto"
    model = configured(build_model)
    blocks = list(blocks) if blocks else declared_blocks(model)
    return candidates(config, applicable_paths(config, precision, model), blocks), blocks


def configured(build_model: Callable[[], nn.Module]) -> nn.Module:
    """The module as ``configure_model`` leaves it, on the meta device, as ``estimate_memory`` builds it."""
    with torch.device("meta"):
        model = build_model()
        with attached(model, DryRunTrainer(transform=None)):
            if callable(getattr(model, "configure_model", None)):
                model.configure_model()
    return model


def fastest_fitting(
    build_model: Callable[[], nn.Module],
    example_batch: Any,
    limit: int,
    precision: str,
    device: str | torch.device,
    config: TransformConfig,
    accumulate_grad_batches: int = 1,
    sharding: Sharding | None = None,
    world_size: int = 1,
    gradient_as_bucket_view: bool = False,
) -> Search:
    """Simulate the candidates of ``config``'s ``"auto"`` settings from the fastest down, and stop at the first
    whose peak is at most ``limit`` bytes. The other arguments as ``estimate_memory`` takes them."""
    device = torch.device(device)
    order, blocks = ladder(build_model, precision, device, config)
    simulate = functools.partial(
        estimate_memory,
        build_model,
        example_batch,
        precision=precision,
        device=device,
        accumulate_grad_batches=accumulate_grad_batches,
        sharding=sharding,
        world_size=world_size,
        gradient_as_bucket_view=gradient_as_bucket_view,
    )
    return search_ladder(order, blocks, config, limit, simulate)


@adapters_resolved_once()  # each candidate rebuilds the config: a pretrained_adapter resolved once, not per candidate
def search_ladder(
    order: list[MemorySettings],
    blocks: list[str],
    config: TransformConfig,
    limit: int,
    simulate: Callable[..., MemoryEstimate],
) -> Search:
    """``fastest_fitting`` over the candidates ``ladder`` gave (``order``, fastest first, and the declared
    ``blocks``): each one's config ``simulate``d (``estimate_memory`` with the run's model and batch bound) until
    one fits in ``limit``."""
    left_out = f"{SELECTIVE_LEFT_OUT}: {SELECTIVE_WHY}" if leaves_selective_out(config, blocks) else ""
    search = Search(limit, len(order), left_out=left_out, blocks=list(blocks))
    with quiet_setup_logs():  # each simulated transform would repeat what the run says once
        for settings in order:
            chosen = settings_config(config, settings, blocks)
            estimate = simulate(config=chosen)
            search.tried.append((settings, chosen, estimate))
            if estimate.peak <= limit:
                break
    return search


def faster_settings_line(
    build_model: Callable[[], nn.Module], example_batch: Any, precision: str, device: str | torch.device, **kwargs: Any
) -> str | None:
    """Where the device's memory is not known (``pl-lowprec estimate`` of a config with ``"auto"`` settings, which
    reports the memory-saving ones): the fastest candidate, its peak, and the free memory from which ``fit`` takes
    it. ``kwargs``: ``config`` and the rest as ``fastest_fitting`` takes them. ``None``, with nothing simulated,
    when there is one candidate (nothing to choose)."""
    device = torch.device(device)
    order, blocks = ladder(build_model, precision, device, kwargs["config"])
    if len(order) < 2:
        return None
    config = kwargs.pop("config")
    simulate = functools.partial(
        estimate_memory, build_model, example_batch, precision=precision, device=device, **kwargs
    )
    search = search_ladder(order, blocks, config, sys.maxsize, simulate)
    peak = search.estimate.peak
    free = format_bytes_at_least(math.ceil(peak / (1 - MARGIN)))
    return (
        f"On a device with at least {free} free, fit would take the fastest settings"
        f" ({search.settings.describe()}): predicted peak {format_bytes(peak)}. Above: the memory-saving settings"
        " ('auto' where the device is not known)."
    )
