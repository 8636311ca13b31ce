"""The optimizer a simulated step runs: the one the run will build, on the fake parameters.

Lightning builds it with the module's ``configure_optimizers`` (which ``--optimizer`` replaces under the CLI,
``cli/deferred_optimizer.py``), after the strategy's transform; the strategy's ``optimizer=`` then swaps an
Adam/AdamW for its 8-bit form. The simulation does the same, so SGD without momentum holds no state, SGD with
momentum one buffer, Adam with ``amsgrad`` a third moment. Several optimizers (which Lightning runs under manual
optimization only) are each built over their own parameters, and the module's ``training_step`` steps them
(``fake_step.py``). Where ``configure_optimizers`` cannot run on the fake parameters (or there is none), or returns
several under automatic optimization (which Lightning refuses), torch's AdamW is assumed, and ``said`` says so.

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
from lightning.pytorch.core.optimizer import _configure_optimizers, _configure_schedulers_manual_opt
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch import nn
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.optim.optimizer import _get_foreach_kernels_supported_devices

from pl_lowprec.memory.bnb_standin import FakeOptimizer8bit
from pl_lowprec.memory.fake_step import manual_optimization
from pl_lowprec.transforms.optimizers import check_swappable, rebind_schedulers, swap_optimizer

EIGHT_BIT = ("adamw8bit", "paged_adamw8bit", "lion8bit", "torchao_adamw8bit")
ASSUMED = "torch AdamW"


class SimulatedOptimizer:
    """Builds the run's optimizers over a fake model (``__call__``); ``said`` describes the last ones built, and
    ``schedulers`` holds their schedulers (what a manual ``training_step`` reads from ``self.lr_schedulers()``)."""

    def __init__(self, swap: str | None, device: torch.device) -> None:
        self.swap, self.device = swap, device
        self.said = ""
        self.schedulers: list[LRSchedulerConfig] = []

    def __call__(self, model: nn.Module) -> list[torch.optim.Optimizer]:
        optimizers, self.schedulers, why_assumed = module_optimizers(model)
        if not optimizers:
            trainable = [p for p in model.parameters() if p.requires_grad]
            optimizers = [torch.optim.AdamW(trainable, lr=1e-4)]
        built = []
        for index, optimizer in enumerate(optimizers):
            picked = pick_loop_for_device(optimizer, self.device)
            said = type(optimizer).__name__ + (f" ({picked})" if picked else "")
            if self.swap is not None:  # each one, as the strategy swaps them (``ModelTransform.swap_optimizers``)
                optimizers[index] = swapped(optimizer, self.swap, self.device)
                rebind_schedulers(self.schedulers, optimizer, optimizers[index])
                said = f"{type(optimizers[index]).__name__} (optimizer={self.swap!r}, replacing {said})"
            built.append(said)
        if why_assumed is not None:
            self.said = f"optimizer assumed: {built[0]}: {why_assumed}"
        elif len(built) == 1:
            self.said = f"optimizer: {built[0]}, from configure_optimizers"
        else:
            self.said = f"{len(built)} optimizers: {', '.join(built)}, from configure_optimizers"
        return optimizers


def module_optimizers(
    model: nn.Module,
) -> tuple[list[torch.optim.Optimizer], list[LRSchedulerConfig], str | None]:
    """The optimizers of ``model.configure_optimizers()`` (any form Lightning accepts) and, under manual
    optimization, their schedulers; or none and why not."""
    if not _overrides_configure_optimizers(model):
        return [], [], f"{type(model).__name__} has no configure_optimizers"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # Lightning's warnings about the returned form: the run says them
            optimizers, schedulers, _ = _configure_optimizers(model.configure_optimizers())
            manual = manual_optimization(model)
            configs = _configure_schedulers_manual_opt(schedulers) if manual else []
    except Exception as err:  # a module's own code on fake parameters and a dry-run trainer: anything may fail
        message = str(err).splitlines()[0] if str(err) else ""
        return [], [], f"configure_optimizers failed on the fake parameters ({type(err).__name__}: {message})"
    if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
        return [], [], "configure_optimizers returned no torch optimizer"
    if len(optimizers) > 1 and not manual:
        why = f"configure_optimizers returned {len(optimizers)} optimizers, which Lightning runs only under manual"
        return [], [], f"{why} optimization (automatic_optimization = False)"
    return list(optimizers), configs, None


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
