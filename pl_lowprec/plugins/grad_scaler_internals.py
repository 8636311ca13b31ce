"""The one place in pl_lowprec that touches ``torch.amp.GradScaler``'s private state.

GradScaler remembers, per optimizer, that ``unscale_`` ran (its stage and its inf checks) until ``update()``,
and offers no public way to forget an unscale that no step followed. A clip without a step, a
``training_step`` that returned ``None`` or an exception between ``unscale_`` and ``step`` would otherwise
leave that optimizer half-done: the next window would not unscale its fresh gradients ("unscale_() has already
been called on this optimizer since the last update()") or fail with "No inf checks were recorded for this
optimizer".

GradScaler also decides on each process alone whether a step overflowed. Under DDP an inf that one rank's
gradients take after the all-reduce (a hook of the user's, an injected fault) skipped the step there and applied
it on the others: the replicas' parameters and scales parted silently, and rank zero logged no skip.
``agree_on_overflow`` all-reduces the verdict after each unscale, as torch's ``ShardedGradScaler`` does.

Private fields touched, checked against torch 2.13.0 (``torch/amp/grad_scaler.py``):

- ``_per_optimizer_states``: a ``defaultdict`` from ``id(optimizer)`` to ``{"stage": OptState, ...}``; a
  missing key reads as the fresh ``READY`` state, so popping one optimizer's entry returns it to ready,
  exactly what ``update()`` does for all of them when it replaces the dict.
- its ``"found_inf_per_device"`` entry, which ``unscale_`` fills (device -> 0-dim float tensor, 1.0 on an
  overflow) and ``step``/``update`` read.

Nothing else is private: the scale, the growth tracker and the settings are read through ``get_scale()``,
``get_growth_interval()``, ... and saved and restored through ``state_dict()`` / ``load_state_dict()``.
"""

from __future__ import annotations

from collections.abc import MutableMapping

import torch
import torch.distributed as dist

from pl_lowprec.distributed.several_ranks import several_ranks

CHECKED_TORCH_VERSION = "2.13.0"


def check_scaler_internals() -> None:
    """Fail when the plugin is built if a torch release changed the field ``forget_unscale`` relies on. Checked on
    a fresh ``GradScaler``: the plugin's own may be a user's subclass or a wrapper around one (Lightning's tests
    wrap it in a ``Mock``), which reach the same field through the class."""
    if not isinstance(getattr(torch.amp.GradScaler("cpu"), "_per_optimizer_states", None), MutableMapping):
        raise RuntimeError(
            f"torch {torch.__version__}'s GradScaler has no per-optimizer state dict (_per_optimizer_states), which"
            f" AMPPrecision uses to forget an unscale that no step followed (checked against torch"
            f" {CHECKED_TORCH_VERSION}). Install the torch version in constraints.txt, or report this with your"
            " torch version."
        )


def forget_unscale(scaler: torch.amp.GradScaler, optimizer_id: int) -> None:
    """Return one optimizer to GradScaler's ready state, as ``update()`` would, without touching the scale."""
    if scaler.is_enabled():
        scaler._per_optimizer_states.pop(optimizer_id, None)


def agree_on_overflow(scaler: torch.amp.GradScaler, optimizer_id: int) -> None:
    """After ``unscale_``: every process of the default group skips the step if any one found inf/NaN. One
    all-reduce of one number; nothing happens in a single process. Every rank calls it on the same steps (the
    plugin unscales once per optimizer step, before ``scaler.step``)."""
    if not (scaler.is_enabled() and several_ranks()):
        return
    found = list(scaler._per_optimizer_states[optimizer_id].get("found_inf_per_device", {}).values())
    device = found[0].device if found else torch.device("cpu")
    if dist.get_backend() == "nccl" and device.type != "cuda":  # NCCL reduces CUDA tensors only
        device = torch.device("cuda", torch.cuda.current_device())
    verdict = torch.zeros((), dtype=torch.float32, device=device)
    for flag in found:
        verdict = torch.maximum(verdict, flag.to(device))
    dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
    for flag in found:
        flag.copy_(verdict)
