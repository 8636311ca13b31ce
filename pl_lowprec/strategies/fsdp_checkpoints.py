"""One gathered checkpoint file for a model sharded with FSDP2, loaded back into the shards on every rank.

Adapter-only checkpoints are small: every rank gathers the trainable tensors, rank 0 writes them with Lightning's
``CheckpointIO``, every rank reads the file and keeps its own rows (``set_model_state_dict``). Optimizer state is
gathered the same way, keyed by parameter name, so a run resumes on any number of ranks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule
from torch.optim import Optimizer

from pl_lowprec.adapters import adapter_checkpoint_keys
from pl_lowprec.distributed.mesh import full_tensor


def gathered_state_dict(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every tensor whole, on the CPU (a collective: every rank calls it with the same keys)."""
    return {key: full_tensor(value.detach()).cpu() for key, value in state_dict.items()}


def load_full_state_dict(
    module: nn.Module, state_dict: Mapping[str, torch.Tensor], adapter_only: bool, strict: bool = True
) -> None:
    """Load whole tensors into a sharded module; with ``adapter_only`` the frozen weights may be missing (and the
    buffers, in a checkpoint written before they were kept), every trainable one must be there."""
    expected = {n for n, p in module.named_parameters() if p.requires_grad} if adapter_only else None
    if expected is not None and strict:
        missing = sorted(expected - set(state_dict))
        unexpected = sorted(set(state_dict) - adapter_checkpoint_keys(module))
        if missing or unexpected:
            raise RuntimeError(
                "The checkpoint does not fit this model's trainable weights."
                f" Unexpected keys: {unexpected[:8]}. Missing trainable keys: {missing[:8]}."
                " Was it written with the same lora= and quantization= settings?"
            )
    reshard(module)
    options = StateDictOptions(full_state_dict=True, strict=strict and not adapter_only)
    set_model_state_dict(module, dict(state_dict), options=options)


def reshard(module: nn.Module) -> None:
    """Every shard unit back to its shards. The root unit keeps its weights gathered after a forward that no
    backward follows (``reshard_after_forward=None``: validate, test, predict, a validation ending a fit), and
    ``set_model_state_dict`` copies into the shards: into gathered weights it fails ("aten.copy_.default got
    mixed torch.Tensor and DTensor"), as ``validate(ckpt_path="best")`` after a fit and the tuners' restore did."""
    for unit in module.modules():
        if isinstance(unit, FSDPModule):
            unit.reshard()


def optimizer_state(module: nn.Module, optimizer: Optimizer) -> dict[str, Any]:
    """The optimizer's state gathered whole and keyed by parameter name (rank 0 holds it; the others get {}).

    An optimizer that has not stepped is saved without state, as ``Optimizer.state_dict()`` saves it (one device,
    ``lowprec_ddp``): torch fills one first with a zero step of its own (AdamW: step 1, zero moments), in the live
    optimizer too, so a save before the first step (``LearningRateFinder``'s, in ``on_fit_start``) made the run's
    first update 0.74 of theirs. The zero step changes no weight (its learning rate is 0) and is undone here."""
    unstepped = not optimizer.state
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_optimizer_state_dict(module, optimizer, options=options)
    if unstepped:
        optimizer.state.clear()
        state = {**state, "state": {}} if state else state
    return state


def load_optimizer_states(module: nn.Module, optimizers: Sequence[Optimizer], states: Sequence[dict]) -> None:
    if len(states) != len(optimizers):
        raise RuntimeError(f"The checkpoint holds {len(states)} optimizer states; the module has {len(optimizers)}.")
    for optimizer, state in zip(optimizers, states, strict=True):
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer
        state = keyed_by_name(module, optimizer, state)
        set_optimizer_state_dict(module, optimizer, state, options=StateDictOptions(full_state_dict=True))
        if not state.get("state"):  # saved before the first step: torch keeps the live state (the tuners' trial
            optimizer.state.clear()  # steps' moments, or its own zero step); Optimizer.load_state_dict clears it


def keyed_by_name(module: nn.Module, optimizer: Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state keyed by position (``Optimizer.state_dict()``: what one device and ``lowprec_ddp`` save)
    keyed by parameter name, as this strategy saves it: ``set_optimizer_state_dict`` takes names only, and stopped
    in ``KeyError: 'state.0.step'``. Positions map to this optimizer's parameters in order, as
    ``Optimizer.load_state_dict`` maps them; a state keyed by name is returned as it is."""
    saved = [key for group in state.get("param_groups", ()) for key in group["params"]]
    if not saved or not all(isinstance(key, int) for key in saved):
        return state
    params = [param for group in optimizer.param_groups for param in group["params"]]
    sizes = [len(group["params"]) for group in optimizer.param_groups]
    saved_sizes = [len(group["params"]) for group in state["param_groups"]]
    if sizes != saved_sizes:
        raise ValueError(
            f"The checkpoint's optimizer state holds parameter groups of {saved_sizes} parameters; this run's optimizer"
            f" has {sizes}. It was saved by another configure_optimizers or other lora=/modules_to_save settings:"
            " resume with the ones it was saved with, or load only its weights (ckpt_path=None and load the"
            " checkpoint's state_dict into the module)."
        )
    names = {id(param): name for name, param in module.named_parameters()}
    name_of = {key: names[id(param)] for key, param in zip(saved, params, strict=True)}
    groups = [{**group, "params": [name_of[key] for key in group["params"]]} for group in state["param_groups"]]
    return {"state": {name_of[key]: value for key, value in state["state"].items()}, "param_groups": groups}
