"""The optimizer a simulated step runs: the one the run will build, on the fake parameters.

Lightning builds it with the module's ``configure_optimizers`` (which ``--optimizer`` replaces under the CLI,
``cli/deferred_optimizer.py``), after the strategy's transform; the strategy's ``optimizer=`` then swaps an
Adam/AdamW for its 8-bit form. The simulation does the same, so SGD without momentum holds no state, SGD with
momentum one buffer, Adam with ``amsgrad`` a third moment. Where ``configure_optimizers`` cannot run on the fake
parameters (or there is none), torch's AdamW is assumed, and ``said`` says so.

torch picks the foreach loop for CUDA tensors when a group names neither (``_default_to_fused_or_foreach``), and
foreach AdamW holds one more copy of every ``exp_avg_sq`` (``_foreach_sqrt``) during the step. Fake parameters are
CPU tensors of a subclass, for which torch picks the single-tensor loop whatever the target device, so the choice
is made here for the device the run is for: foreach on CUDA, the single-tensor loop on a CPU, as torch picks them.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.core.optimizer import _configure_optimizers
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.optim.optimizer import _get_foreach_kernels_supported_devices

from pl_lowprec.memory.bnb_standin import FakeOptimizer8bit
from pl_lowprec.transforms.optimizers import check_swappable, swap_optimizer

EIGHT_BIT = ("adamw8bit", "paged_adamw8bit", "lion8bit", "torchao_adamw8bit")
ASSUMED = "torch AdamW"


class SimulatedOptimizer:
    """Builds the run's optimizer over a fake model (``__call__``); ``said`` describes the last one built."""

    def __init__(self, swap: str | None, device: torch.device) -> None:
        self.swap, self.device = swap, device
        self.said = ""

    def __call__(self, model: nn.Module) -> torch.optim.Optimizer:
        optimizer, why_assumed = module_optimizer(model)
        if optimizer is None:
            trainable = [p for p in model.parameters() if p.requires_grad]
            optimizer = torch.optim.AdamW(trainable, lr=1e-4)
        picked = pick_loop_for_device(optimizer, self.device)
        built = type(optimizer).__name__ + (f" ({picked})" if picked else "")
        if self.swap is not None:
            optimizer = swapped(optimizer, self.swap, self.device)
            built = f"{type(optimizer).__name__} (optimizer={self.swap!r}, replacing {built})"
        if why_assumed is not None:
            self.said = f"optimizer assumed: {built}: {why_assumed}"
        else:
            self.said = f"optimizer: {built}, from configure_optimizers"
        return optimizer


def module_optimizer(model: nn.Module) -> tuple[torch.optim.Optimizer | None, str | None]:
    """The optimizer of ``model.configure_optimizers()`` (any form Lightning accepts), or ``None`` and why not."""
    if not _overrides_configure_optimizers(model):
        return None, f"{type(model).__name__} has no configure_optimizers"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Lightning's warnings about the returned form: the run says them
            optimizers, _, _ = _configure_optimizers(model.configure_optimizers())
    except Exception as err:  # a module's own code on fake parameters and a dry-run trainer: anything may fail
        message = str(err).splitlines()[0] if str(err) else ""
        return None, f"configure_optimizers failed on the fake parameters ({type(err).__name__}: {message})"
    if len(optimizers) != 1 or not isinstance(optimizers[0], torch.optim.Optimizer):
        return None, f"configure_optimizers returned {len(optimizers)} optimizers; the simulated step runs one"
    return optimizers[0], None


def _overrides_configure_optimizers(model: nn.Module) -> bool:
    method = getattr(model, "configure_optimizers", None)
    if method is None:
        return False
    return not isinstance(model, LightningModule) or is_overridden("configure_optimizers", model)


def pick_loop_for_device(optimizer: torch.optim.Optimizer, device: torch.device) -> str | None:
    """Set each group's ``foreach`` as torch would choose it for native tensors on ``device`` (where the group
    leaves it to torch: ``foreach`` and ``fused`` unset, not ``differentiable``); return the loop the first group
    runs: ``"foreach"``, ``"fused"``, ``"single-tensor"``, or ``None`` for an optimizer without that choice."""
    foreach_here = device.type in _get_foreach_kernels_supported_devices()
    loops = []
    for group in optimizer.param_groups:
        if "foreach" not in group:
            continue
        if group["foreach"] is None and not group.get("fused") and not group.get("differentiable", False):
            group["foreach"] = foreach_here
        loops.append("fused" if group.get("fused") else "foreach" if group["foreach"] else "single-tensor")
    return loops[0] if loops else None


def swapped(optimizer: torch.optim.Optimizer, name: str, device: torch.device) -> torch.optim.Optimizer:
    """The strategy's ``optimizer=`` replacement of ``optimizer``, over the same parameter groups; the 8-bit ones as
    their fake stand-in (their real steps refuse fake parameters). Refused here as the run refuses it."""
    if name in EIGHT_BIT:
        check_swappable(optimizer, name)  # swap_optimizer checks the others
        groups: list[dict[str, Any]] = [{"params": group["params"]} for group in optimizer.param_groups]
        return FakeOptimizer8bit(groups, states=1 if name == "lion8bit" else 2, torchao=name.startswith("torchao"))
    with unset_fake_temporarily():  # bitsandbytes builds its quantization maps from Python lists, for real
        return swap_optimizer(optimizer, name, device)
