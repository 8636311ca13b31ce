"""``plan_memory``: the fastest memory settings whose predicted peak fits a budget.

The model, the sequence length and the global batch (micro-batch x accumulation x devices) stay as the config
has them; what is searched only trades memory for time and never changes what is learned:

- the micro-batch, with accumulation adjusted so the global batch stays the same (with a token-mean loss, as
  ``CausalLM``'s, the optimizer steps are the same);
- activation checkpointing and the memory-saving paths, as ``fit``'s ``"auto"`` chooses them: the candidates
  of ``fastest.ladder`` (one list, fastest first: nothing traded, then the loss's paths, then every path, then
  selective, every 2nd block and every block checkpointed), where the config says ``"auto"`` or, for
  checkpointing, names no blocks; what the config gives explicitly is kept in every candidate (pinned);
- the 8-bit AdamW (``optimizer="adamw8bit"``; under ``lowprec_fsdp`` ``"torchao_adamw8bit"``) in place of torch's;
- activation offloading, on CUDA only.

Quantization changes the model, so it is searched only where the config already quantizes (its mode is kept)
or with ``allow_quantization`` (then nf4-dq is tried too); it is never switched on silently.

Each candidate is simulated by ``estimate_memory`` (one fake step through the strategy's own transform). For
each micro-batch the ladder is walked as ``fit`` walks it, from the fastest rung down, and stops at the first
rung that fits without further changes: so at the config's micro-batch the plan holds exactly what ``"auto"``
would choose for the same limit, and slower rungs of a micro-batch that already fits are not simulated. The
fitting candidates are ranked by the predicted time of their optimizer step on the device
(``estimate.step_time_on``: each kernel's FLOPs, bytes and launch, ``step_time.py``), which sees what FLOPs
alone did not: the recompute of memory-bound ops under selective checkpointing, and the launches of more,
smaller micro-batches. Steps predicted within 5% of the fastest are ties (on a CPU the kernels are timed, and
vary that much from run to run); ties go to the larger micro-batch, then to the rung ``fit`` tries first, then
to fewer changes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pl_lowprec.distributed.sharding import Sharding
from pl_lowprec.loading.sources import shapes_only
from pl_lowprec.memory.devices import device_spec
from pl_lowprec.memory.estimate import MemoryEstimate, estimate_memory, resolved_precision, timed_device
from pl_lowprec.memory.fake_model import meta_copy
from pl_lowprec.memory.fastest import SELECTIVE_LEFT_OUT, MemorySettings, ladder, leaves_selective_out
from pl_lowprec.memory.fastest import predicted_seconds as rung_order
from pl_lowprec.memory.fastest import settings_config as rung_config
from pl_lowprec.memory.quiet import quiet_setup_logs
from pl_lowprec.memory.sizes import format_bytes
from pl_lowprec.memory.step_time import StepTime, predict_step_time
from pl_lowprec.transforms.config import TransformConfig
from pl_lowprec.transforms.memory_saving import AUTO
from pl_lowprec.transforms.pretrained_adapter import adapters_resolved_once

ASSUMED_GPU = "H100"  # the GPU a CUDA plan is timed on when none is named and this machine has none


@dataclass(frozen=True)
class Settings:
    """One point of the search: what the planned config sets. ``memory``: a rung of ``fastest.ladder``, the
    checkpointing and memory-saving paths that ``"auto"`` chooses among (``GIVEN``, as given, where pinned)."""

    micro_batch: int
    accumulate: int
    memory: MemorySettings
    optimizer: str | None = None
    activation_offloading: bool = False
    quantization: str | None = None  # None: as the config has it; else switched on (allow_quantization)

    @property
    def checkpointing(self) -> str:
        """``"none"``, ``"selective"``, ``"every 2nd block"``, ``"every block"``, or ``GIVEN``."""
        return self.memory.checkpointing

    def describe(self) -> str:
        """What the search chose, in words (what the config pins is said once: ``MemoryPlan.pinned``)."""
        parts = [f"micro-batch {self.micro_batch} x {self.accumulate}", *self.memory.chosen_words()]
        if self.optimizer:
            parts.append(f"optimizer {self.optimizer}")
        if self.activation_offloading:
            parts.append("offloading")
        if self.quantization:
            parts.append(f"quantization {self.quantization}")
        return ", ".join(parts)


@dataclass
class Candidate:
    settings: Settings
    estimate: MemoryEstimate
    fits: bool
    step: StepTime  # the predicted optimizer step on the plan's device

    @property
    def peak(self) -> int:
        return self.estimate.peak


@dataclass
class MemoryPlan:
    """The ranked candidates (fitting ones first, fastest first) and the chosen one (``None``: nothing fits).
    ``time_on``: the device the steps are timed on (``assumed``: named by no one, see ``ASSUMED_GPU``)."""

    budget: int
    margin: float
    candidates: list[Candidate] = field(default_factory=list)
    time_on: str = "cpu"
    assumed: bool = False
    quantization: str | None = None  # the config's mode: what the advice on weights may still offer
    pinned: list[str] = field(default_factory=list)  # the config's own checkpointing, kept in every candidate

    @property
    def limit(self) -> int:
        """The bytes a candidate's peak may reach: the budget less the margin."""
        return int(self.budget * (1 - self.margin))

    @property
    def chosen(self) -> Candidate | None:
        return next((c for c in self.candidates if c.fits), None)

    def table(self, rows: int = 12) -> str:
        """The ``rows`` best candidates (all that fit first), and how many more were simulated; in GiB, or in MiB
        for a budget under 1 GiB (a small model's peaks read 0.000 GiB)."""
        unit, scale = ("GiB", 2**30) if self.budget >= 2**30 else ("MiB", 2**20)
        device = self.candidates[0].step.device if self.candidates else self.time_on
        assumed = " (assumed: no GPU with known figures here; name one with --gpu)" if self.assumed else ""
        lines = [
            f"Budget {self.budget / scale:.2f} {unit}, margin {self.margin:.0%}: a peak up to"
            f" {self.limit / scale:.2f} {unit} fits. Ranked by the predicted optimizer step on {device}{assumed}."
            f"{self._ties()}",
            f"  {'fits':<5}{f'peak {unit}':>10}{f'headroom {unit}':>14}{'step s':>9}  settings",
        ]
        for c in self.candidates[:rows]:
            mark = "*" if c is self.chosen else " "
            headroom = (self.limit - c.peak) / scale
            lines.append(
                f"{mark} {'yes' if c.fits else 'no':<5}{c.peak / scale:>10.3f}{headroom:>14.3f}"
                f"{c.step.seconds:>9.3f}  {c.settings.describe()}"
            )
        if len(self.candidates) > rows:
            lines.append(f"  ... and {len(self.candidates) - rows} more simulated, all ranked lower.")
        return "\n".join(lines)

    def _ties(self) -> str:
        """Why a slower row may stand above a faster one: the sentence on ties, where there are some."""
        tied = len(tied_with_the_fastest(self.candidates))
        if tied < 2:
            return ""
        return (
            f" Steps within {TIED:.0%} of the fastest ({tied} here) are ties, as the timing varies that much: the"
            " larger micro-batch first, then the settings fit's 'auto' tries first, then fewer changes."
        )

    def chosen_line(self) -> str:
        """The chosen candidate in one line: what the plan chose, what it kept as the config gives it, the
        prediction."""
        chosen = self.chosen
        if chosen is None:
            raise ValueError("nothing fits: say nothing_fits() instead")
        pinned = ", ".join(self.pinned + chosen.settings.memory.pinned_words()) or "nothing"
        return (
            f"Chosen: {chosen.settings.describe()}; pinned as the config gives them: {pinned}; predicted peak"
            f" {format_bytes(chosen.peak)}, step {chosen.step.seconds:.3f} s on {chosen.step.device}."
        )

    def nothing_fits(self) -> str:
        """One paragraph: the smallest peak found, what dominates it, and what to change."""
        smallest = min(self.candidates, key=lambda c: c.peak)
        split = {k: v for k, v in smallest.estimate.peak_split.items() if v}
        top = sorted(split.items(), key=lambda kv: -kv[1])[:3]
        parts = ", ".join(f"{k.replace('_', ' ')} {format_bytes(v)}" for k, v in top)
        advice = {
            "weights": weights_advice(smallest.settings.quantization or self.quantization),
            "activations": "shorter sequences (TextDataModule's seq_len, or the rows your data module makes), or"
            " activation offloading on a GPU",
            "temporaries": "shorter sequences (a smaller micro-batch is already tried), or a smaller loss chunk"
            " (CausalLM loss_chunk_size) where the logits dominate",
            "optimizer_state": "the 8-bit optimizer or fewer trainable parameters (a smaller LoRA rank)",
            "gradients": "fewer trainable parameters (LoRA instead of a full fine-tune)",
            "ddp_buckets": "fewer trainable parameters (LoRA instead of a full fine-tune), or lowprec_fsdp, whose"
            " ranks hold a shard of the gradients and no DDP buckets",
        }.get(top[0][0], "shorter sequences or more devices")
        return (
            f"Nothing fits in {format_bytes(self.limit)} (budget {format_bytes(self.budget)} less the"
            f" {self.margin:.0%} margin): the smallest predicted peak of the {len(self.candidates)} candidates is"
            f" {format_bytes(smallest.peak)} ({smallest.settings.describe()}), of which {parts}. The largest"
            f" part is {top[0][0].replace('_', ' ')}: {advice}."
        )


def weights_advice(quantization: str | None) -> str:
    """What still shrinks the weights: 4-bit where they are not 4-bit yet, else sharding or a smaller model."""
    shard = "shard them over more devices (lowprec_fsdp with --devices N)"
    if quantization is None:
        return f"quantize the base weights (--allow_quantization, or quantization: nf4-dq), or {shard}"
    if quantization == "int8":
        return f"4-bit base weights (quantization: nf4-dq) take half of int8's, or {shard}"
    return f"the base weights are 4-bit already (quantization: {quantization}): {shard}, or take a smaller model"


@adapters_resolved_once()  # each candidate rebuilds the config: a pretrained_adapter resolved once, not per candidate
@shapes_only()  # a pretrained= directory with only config.json: its shapes are all an estimate needs
def plan_memory(
    build_model: Callable[[], nn.Module],
    make_batch: Callable[[int], Any],
    budget: int,
    global_batch: int,
    precision: str = "32-true",
    device: str | torch.device = "cpu",
    config: TransformConfig | None = None,
    devices: int = 1,
    margin: float = 0.1,
    allow_quantization: bool = False,
    block_names: list[str] | None = None,
    cache: dict[Settings, MemoryEstimate] | None = None,
    sharding: Sharding | None = None,
    time_on: str | None = None,
    micro_batch: int | None = None,
    gradient_as_bucket_view: bool = False,
    simulated: Sequence[Simulated] = (),
) -> MemoryPlan:
    """Simulate the candidates (``Settings``; per micro-batch down ``fastest.ladder`` to the first rung that
    fits) and rank them by predicted step time.

    Args:
        build_model: Builds the module, untransformed, on each call (called on the meta device).
        make_batch: One micro-batch of the given number of rows, at the run's sequence length.
        budget: Bytes of device memory per device.
        global_batch: Rows per optimizer step over all devices (micro-batch x accumulation x devices).
        config: The strategy's model arguments; the searched ones (``searched_config``) are replaced per
            candidate, the others kept.
        block_names: The block classes to checkpoint when the config names none (default: the module's
            ``_no_split_modules``, as ``"auto"`` takes them).
        cache: Estimates by settings, kept across calls that differ only in ``budget`` or ``margin``.
        sharding: The config's FSDP2 sharding (``strategy.transform_sharding(config)``): every candidate is
            simulated per rank of ``devices``.
        time_on: The device the steps are timed on (``estimate_memory``'s ``time_on``); ``None``: ``device``,
            and for CUDA without a GPU here, ``ASSUMED_GPU`` (the table says so).
        micro_batch: Search only this micro-batch (a module's own loader: nothing sets its batch size).
        gradient_as_bucket_view: DDP's own argument, as ``estimate_memory`` takes it.
        simulated: Estimates made already with these arguments (``Simulated``: a refused ``fit``'s automatic
            choice), taken for the candidates with the same config, micro-batch and accumulation.
    """
    config = searched_config(config or TransformConfig())
    device = torch.device(device)
    precision = resolved_precision(precision, device, time_on)  # "bf16" as "bf16-mixed"; "auto" as chosen there
    timed = timed_device(time_on, device, precision)
    mode = config.quantization.mode if config.quantization is not None else None
    plan = MemoryPlan(budget, margin, time_on=timed or ASSUMED_GPU, assumed=timed is None, quantization=mode)
    spec = device_spec(plan.time_on)
    rungs, blocks = ladder(build_model, precision, device, config, block_names)  # fit's own candidates
    plan.pinned = pinned_checkpointing(config, blocks)
    extras = variants(config, device, allow_quantization, sharded=sharding is not None)
    per_device = rows_per_device(global_batch, devices)
    for micro in micro_batches(per_device) if micro_batch is None else [micro_batch]:
        worth = len(extras)  # the variants still worth simulating at slower rungs
        for rung in rungs:  # fastest first, as fit walks them
            for index, (optimizer, offloading, quantization) in enumerate(extras[:worth]):
                settings = Settings(micro, per_device // micro, rung, optimizer, offloading, quantization)
                candidate_config = settings_config(config, settings, blocks)
                estimate = None if cache is None else cache.get(settings)
                if estimate is None:
                    estimate = simulated_already(simulated, candidate_config, micro, settings.accumulate)
                if estimate is None:
                    with quiet_setup_logs():  # the transform's setup lines, once per candidate otherwise
                        estimate = estimate_memory(
                            build_model,
                            make_batch(settings.micro_batch),
                            precision=precision,
                            device=device,
                            config=candidate_config,
                            accumulate_grad_batches=settings.accumulate,
                            sharding=sharding,
                            world_size=devices,
                            gradient_as_bucket_view=gradient_as_bucket_view,
                        )
                    if cache is not None:
                        cache[settings] = estimate
                step = predict_step_time(estimate.ops, spec)
                plan.candidates.append(Candidate(settings, estimate, estimate.peak <= plan.limit, step))
                if plan.candidates[-1].fits:  # slower rungs only for variants with fewer changes than this one
                    worth = index
                    break
            if worth == 0:  # fits with no change but the rung: where fit's "auto" stops too
                break
    plan.candidates.sort(key=_ranking(plan.candidates))
    return plan


@dataclass(frozen=True)
class Simulated:
    """An estimate made already, outside the plan, with the plan's other arguments: ``config`` at ``micro_batch``
    rows (``make_batch``'s) and ``accumulate`` micro-batches per step."""

    config: TransformConfig
    micro_batch: int
    accumulate: int
    estimate: MemoryEstimate


def simulated_already(
    simulated: Sequence[Simulated], config: TransformConfig, micro_batch: int, accumulate: int
) -> MemoryEstimate | None:
    """The estimate of ``simulated`` made for exactly this candidate (a fake step costs seconds), or ``None``."""
    for done in simulated:
        if (done.config, done.micro_batch, done.accumulate) == (config, micro_batch, accumulate):
            return done.estimate
    return None


TIED = 0.05  # predicted steps within 5% of the fastest are tied: a measured CPU's kernel times vary that much


def tied_with_the_fastest(candidates: list[Candidate]) -> list[Candidate]:
    """The fitting candidates whose predicted step is within ``TIED`` of the fastest fitting one's."""
    fastest = min((c.step.seconds for c in candidates if c.fits), default=0.0)
    return [c for c in candidates if c.fits and c.step.seconds <= fastest * (1 + TIED)]


def _ranking(candidates: list[Candidate]) -> Callable[[Candidate], tuple]:
    """Fitting candidates first; those within ``TIED`` of the fastest, the larger micro-batch first, then the rung
    ``fit`` tries first (``fastest.predicted_seconds``: no checkpointing, fewer memory-saving paths), then fewer
    changes; then the rest, fastest first."""
    tied_ones = {id(c) for c in tied_with_the_fastest(candidates)}

    def key(c: Candidate) -> tuple:
        tied = id(c) in tied_ones
        return (
            not c.fits,
            not tied,
            0.0 if tied else c.step.seconds,
            -c.settings.micro_batch,
            rung_order(None, c.settings.memory),
            _changes(c),
            c.step.seconds,
        )

    return key


def rows_per_device(global_batch: int, devices: int) -> int:
    """The rows of one optimizer step on each device; ``ValueError`` where they do not split evenly."""
    per_device, rest = divmod(global_batch, devices)
    if rest or per_device < 1:
        raise ValueError(
            f"The global batch of {global_batch} rows does not split evenly over {devices} devices: make it a"
            " multiple of the device count (data batch_size x accumulate_grad_batches x devices)."
        )
    return per_device


def micro_batches(per_device: int) -> list[int]:
    """The micro-batches searched, largest first: the powers of two and ``per_device`` itself that divide it."""
    return sorted({b for b in (1, 2, 4, 8, 16, 32, 64, 128, per_device) if per_device % b == 0}, reverse=True)


def variants(
    config: TransformConfig, device: torch.device, allow_quantization: bool, sharded: bool = False
) -> list[tuple[str | None, bool, str | None]]:
    """``(optimizer, activation_offloading, quantization)`` besides the rung, from the fewest changes to the most:
    the 8-bit optimizer, offloading on CUDA, then quantization where allowed; a variant is simulated only when the
    ones before it do not fit. Sharded (``lowprec_fsdp``), the 8-bit optimizer is torchao's, which steps on
    shards."""
    optimizers = [config.optimizer]
    if config.optimizer in (None, "adamw"):
        optimizers.append("torchao_adamw8bit" if sharded else "adamw8bit")
    offloading = [False, True] if device.type == "cuda" else [False]
    quantization: list[str | None] = [None]  # None: the config's own (unquantized, or its mode)
    if allow_quantization and config.quantization is None:
        quantization.append("nf4-dq")
    return [(optimizer, offload, quant) for quant in quantization for offload in offloading for optimizer in optimizers]


def pinned_checkpointing(config: TransformConfig, blocks: list[str]) -> list[str]:
    """The config's own checkpointing, in words, where the search keeps it (``fastest.GIVEN``), or the candidate
    its ``checkpoint_impl`` rules out; nothing where the plan chooses it all."""
    if config.activation_checkpointing == AUTO:
        return [f"checkpoint_impl reentrant ({SELECTIVE_LEFT_OUT})"] if leaves_selective_out(config, blocks) else []
    policy = config.activation_checkpointing
    names = policy if isinstance(policy, (list, tuple, set, frozenset)) else [policy]
    named = ", ".join(sorted(block_names(list(names))))
    n = config.checkpoint_every_n
    every = f", every {n}{ORDINAL_SUFFIX.get(n, 'th')} block" if n > 1 else ""
    mode = ", selective" if config.checkpoint_mode == "selective" else ""
    impl = ", reentrant" if config.checkpoint_impl == "reentrant" else ""
    return [f"activation checkpointing on {named}{every}{mode}{impl}"]


ORDINAL_SUFFIX = {2: "nd", 3: "rd"}


def block_names(value: Any) -> Any:
    """A list of block classes or names as names (how a config writes them); anything else as it is."""
    if isinstance(value, (list, tuple)):
        return [v if isinstance(v, str) else getattr(v, "__name__", str(v)) for v in value]
    return value


def settings_config(config: TransformConfig, settings: Settings, blocks: list[str] | None) -> TransformConfig:
    """``config`` (``searched_config``'s) with the candidate's settings: its rung as ``fit`` sets it
    (``fastest.settings_config``, which leaves no ``"auto"``), and the plan's own variants."""
    planned = rung_config(searched_config(config), settings.memory, list(blocks or []))
    changes: dict[str, Any] = {"optimizer": settings.optimizer, "activation_offloading": settings.activation_offloading}
    if settings.quantization is not None:
        changes["quantization"] = settings.quantization
    return dataclasses.replace(planned, **changes)


def searched_config(config: TransformConfig) -> TransformConfig:
    """The config as the plan searches it: its ``"auto"`` settings, and checkpointing where it names no blocks (a
    config the plan may checkpoint, as the plan always read it), are chosen among ``fit``'s own candidates
    (``fastest.ladder``); whatever else it gives is kept. The written config names what was chosen, never
    ``"auto"``, so ``fit`` runs what was simulated rather than choosing again."""
    if config.activation_checkpointing is None:
        return dataclasses.replace(config, activation_checkpointing=AUTO)
    return config


def checkpointed_blocks(config: TransformConfig, block_names: list[str] | None) -> Any:
    """The blocks checkpointing (and FSDP2's shard units) apply to: the config's, or ``block_names`` where it
    leaves them to the plan."""
    if config.activation_checkpointing in (None, AUTO):
        return block_names
    return config.activation_checkpointing


def fresh_copies(model: nn.Module) -> Callable[[], nn.Module]:
    """A builder returning an untransformed copy of ``model`` on each call (the estimate transforms in place)."""
    original = meta_copy(model)
    return lambda: meta_copy(original)


def resized(batch: Any, rows: int, seq_len: int | None = None) -> Any:
    """``batch`` with ``rows`` rows (repeated or cut) and, for 2-d tensors, ``seq_len`` positions (tiled or cut)."""
    if isinstance(batch, dict):
        return {k: resized(v, rows, seq_len) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(resized(v, rows, seq_len) for v in batch)
    if not isinstance(batch, torch.Tensor) or batch.dim() == 0:
        return batch
    index = torch.arange(rows) % batch.shape[0]
    out = batch[index]
    if seq_len is not None and out.dim() >= 2:
        positions = torch.arange(seq_len) % out.shape[1]
        out = out[:, positions]
    return out


def largest_fitting(fits: Callable[[int], bool], low: int, high: int) -> int | None:
    """The largest value in ``[low, high]`` for which ``fits`` holds, assuming it holds below some threshold;
    ``None`` when even ``low`` does not fit."""
    if not fits(low):
        return None
    while low < high:
        middle = (low + high + 1) // 2
        if fits(middle):
            low = middle
        else:
            high = middle - 1
    return low


def largest_by_doubling(fits: Callable[[int], bool], start: int, ceiling: int) -> int | None:
    """The largest value in ``[start, ceiling]`` for which ``fits`` holds (``None``: not even ``start``): doubled to
    a bracket, then bisected. Each value is asked once: the bisection starts from the bracket's fitting end, and a
    ``fits`` that simulates a step costs seconds."""
    fits = functools.cache(fits)
    if not fits(start):
        return None
    low, high = doubling_bound(fits, start, ceiling)
    return largest_fitting(fits, low, high)


def doubling_bound(fits: Callable[[int], bool], start: int, ceiling: int) -> tuple[int, int]:
    """``(last fitting, first failing or ceiling)`` by doubling from ``start``: the bracket to bisect."""
    good, value = start, start
    while value < ceiling:
        value = min(ceiling, value * 2)
        if not fits(value):
            return good, value - 1
        good = value
    return good, ceiling


def _changes(candidate: Candidate) -> tuple[bool, bool, bool]:
    s = candidate.settings
    return s.quantization is not None, s.activation_offloading, s.optimizer in ("adamw8bit", "torchao_adamw8bit")
