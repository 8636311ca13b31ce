"""Does a module's step keep the samples of a packed row apart? Change the tokens before a sample, compare its outputs.

The step runs twice on one row of a packed batch: as it is, and with every token before one of the row's later
samples replaced by another token of the batch. Forward hooks on the module's Hugging Face models
(``transformers.PreTrainedModel``) record what the outermost one was called with and the per-token output
(``last_hidden_state``, else ``logits``) of the first to return, and stop the step when the outermost returns (by a
``BaseException``, which ``except Exception`` does not catch): nothing after the model call runs, so no loss, log,
metric update or backward. If the later sample's outputs moved, its attention reached the tokens before it.

Both runs draw the same random numbers (dropout), under ``torch.no_grad``, in the train/eval mode and precision
context the step runs in; afterwards the random generators and normalization running statistics are as before.
Assumed: the step calls a Hugging Face model on the row's tokens, with outputs per position (``[1, T, ...]``); what
the step does before that call (rarely anything but reading the batch) runs twice more.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pl_lowprec.models.token_loss import IGNORE_INDEX

Batch = Mapping[str, Any]

# Largest change of a position's outputs (mean absolute change over its values, relative to their mean magnitude)
# that still counts as unchanged. On a tiny random Llama a cache, an attention_mask or missing position_ids move
# every position of the later sample by 0.13 to 0.26 of its size; an isolated step's outputs are equal to the bit
# on the CPU (the same shapes run the same kernels). The CUDA bf16 margin has a test (cuda marker).
TOLERANCE = 1e-3


@dataclass(frozen=True)
class ProbeRow:
    """Row ``row`` of a batch, whose sample at positions ``[start, end)`` is compared; the tokens before change."""

    row: int
    start: int
    end: int


@dataclass
class ModelCall:
    """The outermost Hugging Face model call of a step: the model, its keyword arguments, a per-token output."""

    model: nn.Module
    kwargs: dict[str, Any]
    positional: int  # how many arguments came by position
    output: torch.Tensor | None = None  # the compared positions of the first per-token output to return


@dataclass(frozen=True)
class IsolationResult:
    """What a check saw: the call, and how many compared positions moved (``None``: no per-token output)."""

    probe: ProbeRow
    call: ModelCall | None
    moved: int | None = None
    change: float = 0.0
    compared: int = 0  # positions of the sample compared

    @property
    def observed(self) -> bool:
        return self.moved is not None

    @property
    def keeps_apart(self) -> bool:
        return self.moved == 0


class _ModelReturned(BaseException):
    """Ends the step when its outermost Hugging Face model has returned."""


def hf_models(module: nn.Module) -> list[nn.Module]:
    """The ``transformers.PreTrainedModel`` instances inside ``module`` (none without transformers installed)."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return []
    return [m for m in module.modules() if isinstance(m, PreTrainedModel)]


def sample_bounds(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, end)`` of each sample of a row: one starts where the position does not follow the one before
    (transformers' rule, ``masking_utils.find_packed_sequence_indices``)."""
    starts = [0, *(torch.nonzero(position_ids[1:] != position_ids[:-1] + 1).squeeze(1) + 1).tolist()]
    return list(zip(starts, [*starts[1:], len(position_ids)], strict=True))


def probe_row(batch: Batch) -> ProbeRow | None:
    """The first sample after the first of some row that has a target token (the padding ending a row has none);
    ``None`` when no row holds two samples, or the batch has a single distinct token to change them to."""
    ids, positions, labels = batch["input_ids"], batch["position_ids"], batch.get("labels")
    if torch.unique(ids).numel() < 2:
        return None
    for row in range(ids.shape[0]):
        for start, end in sample_bounds(positions[row].cpu())[1:]:
            if labels is None or bool((labels[row, start:end] != IGNORE_INDEX).any()):
                return ProbeRow(row, start, end)
    return None


def row_batch(batch: Batch, row: int) -> dict[str, Any]:
    """The batch restricted to one row (tensors with the batch's first dimension; anything else as it is)."""
    size = batch["input_ids"].shape[0]
    return {k: v[row : row + 1] if torch.is_tensor(v) and v.dim() and len(v) == size else v for k, v in batch.items()}


def with_tokens_changed_before(one_row: dict[str, Any], start: int, vocabulary: torch.Tensor) -> dict[str, Any]:
    """``one_row`` with each token before ``start`` replaced by the next token of ``vocabulary`` (sorted, >= 2)."""
    ids = one_row["input_ids"].clone()
    index = torch.searchsorted(vocabulary, ids[0, :start])
    ids[0, :start] = vocabulary[(index + 1) % vocabulary.numel()]
    return {**one_row, "input_ids": ids}


def per_token(output: Any, length: int) -> torch.Tensor | None:
    """The per-position tensor ``[1, length, ...]`` of a model's output: ``last_hidden_state``, ``logits``, or the
    first such tensor of a tuple."""
    candidates = [getattr(output, name, None) for name in ("last_hidden_state", "logits")]
    if isinstance(output, (tuple, list)):
        candidates += list(output)
    candidates.append(output)
    for value in candidates:
        if torch.is_tensor(value) and value.dim() >= 2 and tuple(value.shape[:2]) == (1, length):
            return value
    return None


@contextmanager
def first_model_call(models: list[nn.Module], length: int, positions: slice) -> Iterator[list[ModelCall]]:
    """Records the outermost call among ``models`` (kwargs, and ``positions`` of the first per-token output any of
    them returns) and ends the step when it returns."""
    calls: list[ModelCall] = []
    active: list[nn.Module] = []

    def before(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
        if not active and not calls:
            calls.append(ModelCall(module, dict(kwargs), len(args)))
        active.append(module)

    def after(module: nn.Module, args: tuple, kwargs: dict[str, Any], output: Any) -> None:
        active.pop()
        if not calls:
            return
        if calls[0].output is None and (tensor := per_token(output, length)) is not None:
            calls[0].output = tensor[0, positions].detach().clone()
        if not active and module is calls[0].model:
            raise _ModelReturned

    handles = [m.register_forward_pre_hook(before, with_kwargs=True) for m in models]
    handles += [m.register_forward_hook(after, with_kwargs=True) for m in models]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def rewindable_randomness(device: torch.device) -> Iterator[Callable[[], None]]:
    """Yields a function that puts torch's generators (CPU, and ``device`` if CUDA) back where they were on entry;
    they are put back on exit too."""
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def rewind() -> None:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(cuda, device)

    try:
        yield rewind
    finally:
        rewind()


@contextmanager
def kept_running_statistics(module: nn.Module) -> Iterator[None]:
    """Normalization layers that track running statistics (batch norm in training) get theirs back on exit."""
    tracking = [m for m in module.modules() if m.training and getattr(m, "track_running_stats", False)]
    saved = [[b.clone() for b in m.buffers(recurse=False)] for m in tracking]
    try:
        yield
    finally:
        with torch.no_grad():
            for layer, buffers in zip(tracking, saved, strict=True):
                for buffer, copy in zip(layer.buffers(recurse=False), buffers, strict=True):
                    buffer.copy_(copy)


def run_until_model_returns(
    step: Callable[[dict], Any], batch: dict, models: list[nn.Module], probe: ProbeRow
) -> ModelCall | None:
    """The outermost model call of ``step(batch)``, the step ended right after it (``None``: no model was called)."""
    positions = slice(probe.start, probe.end)
    with first_model_call(models, batch["input_ids"].shape[1], positions) as calls, suppress(_ModelReturned):
        step(batch)
    return calls[0] if calls else None


def check_isolation(
    step: Callable[[dict], Any], batch: Batch, probe: ProbeRow, module: nn.Module, models: list[nn.Module]
) -> IsolationResult:
    """Runs ``step`` on row ``probe.row`` of ``batch``, then on the same row with the tokens before ``probe.start``
    changed, and compares the outputs at ``[probe.start, probe.end)``."""
    one_row = row_batch(batch, probe.row)
    changed = with_tokens_changed_before(one_row, probe.start, torch.unique(batch["input_ids"]))
    with torch.no_grad(), kept_running_statistics(module), rewindable_randomness(one_row["input_ids"].device) as rewind:
        call = run_until_model_returns(step, one_row, models, probe)
        rewind()
        changed_call = run_until_model_returns(step, changed, models, probe)
    if call is None or call.output is None or changed_call is None or changed_call.output is None:
        return IsolationResult(probe, call)
    reference = call.output.float().reshape(call.output.shape[0], -1)
    difference = (changed_call.output.float().reshape(reference.shape) - reference).abs().mean(1)
    change = difference / reference.abs().mean(1).clamp_min(torch.finfo(torch.float32).tiny)
    call.output = changed_call.output = None  # a sample's logits can be large: not kept for the rest of the fit
    return IsolationResult(probe, call, int((change > TOLERANCE).sum()), float(change.max()), len(change))
