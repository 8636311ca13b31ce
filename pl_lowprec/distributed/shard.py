"""FSDP2 ``fully_shard`` of a transformed model: which blocks form a shard unit, and the one place that shards
them, bottom-up and then the LightningModule itself as the root (torchtune's ``shard_model``), whose step methods
run as the root's forward (``shard_root``). The units are chosen like activation checkpointing's blocks (classes,
class names or a predicate), and a name that matches nothing lists the model's classes.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import nn
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method

from pl_lowprec.distributed.meta_init import meta_stand_ins
from pl_lowprec.transforms.checkpointing import CheckpointPolicy, resolved_blocks, select_modules

ShardPolicy = CheckpointPolicy


def shard_units(model: nn.Module, policy: ShardPolicy | None) -> list[tuple[str, nn.Module]]:
    """The blocks that each become one FSDP unit; where none are named (``None``, or ``"auto"`` from
    ``activation_checkpointing="auto"``), the blocks the model declares (Hugging Face's ``_no_split_modules``, its
    decoder layer, as accelerate's FSDP wraps by default); ``ValueError`` listing the model's classes if it
    declares none."""
    policy = resolved_blocks(model, "auto" if policy is None else policy)
    if policy is None:
        classes = sorted({type(m).__name__ for m in model.modules()})
        raise ValueError(
            f"strategy='lowprec_fsdp' needs to know which blocks of {type(model).__name__} to shard, and it declares"
            " none (no Hugging Face model with _no_split_modules in it): pass shard_modules= (or"
            " activation_checkpointing=, whose blocks are then the shard units), e.g. the decoder layer class."
            f" The model contains these classes: {', '.join(classes)}."
        )
    return select_modules(model, policy, argument="shard_modules")


STEP_METHODS = ("training_step", "validation_step", "test_step", "predict_step")


def step_methods(model: nn.Module) -> list[str]:
    """The step methods a LightningModule defines itself: each runs as the FSDP root's forward."""
    if not isinstance(model, pl.LightningModule):
        return []
    return [name for name in STEP_METHODS if is_overridden(name, model, pl.LightningModule)]


def shard_root(model: nn.Module, **options: Any) -> list[str]:
    """``fully_shard`` the LightningModule itself as the root, and run each of its step methods as the root's
    forward (FSDP2's ``register_fsdp_forward_method``); return those methods' names.

    Whatever a step calls then sees gathered parameters: the model's own forward, or a submodule and a head
    called one by one (``CausalLM``'s chunked loss calls the base model and then the output embedding), or a
    parameter the module holds itself. This is what Lightning does for DDP and FSDP1, whose wrapper's forward
    runs the step. The root keeps FSDP2's own choice for a root: gathered from the step until its backward."""
    fully_shard(model, **{**options, "reshard_after_forward": None})
    methods = step_methods(model)
    for name in methods:
        register_fsdp_forward_method(model, name)
    return methods


def shard_pretrained_blocks(module: nn.Module, network: nn.Module, mesh: Any) -> list[str]:
    """FSDP2 for a LightningModule holding a Hugging Face model, under Lightning's own ``ModelParallelStrategy``
    (whose ``configure_model`` must shard): each block the model names in ``_no_split_modules`` (its decoder
    layer) is a unit, then the module itself is the root (``shard_root``); returns the unit names."""
    dims = tuple(mesh.mesh_dim_names or ())
    if "tensor_parallel" in dims and mesh["tensor_parallel"].size() > 1:
        raise ValueError(
            f"{type(module).__name__} shards data-parallel only, and ModelParallelStrategy has tensor_parallel_size="
            f"{mesh['tensor_parallel'].size()} (its 'auto' puts every device of a node in tensor parallelism). Pass"
            " ModelParallelStrategy(data_parallel_size=<devices>, tensor_parallel_size=1), or strategy='lowprec_fsdp'."
        )
    data_parallel = mesh["data_parallel"] if "data_parallel" in dims else mesh
    names = set(getattr(network, "_no_split_modules", None) or ())
    blocks = [(name, m) for name, m in network.named_modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(
            f"{type(network).__name__} names no blocks to shard (_no_split_modules={sorted(names)}): use"
            " strategy='lowprec_fsdp' with shard_modules=[...]."
        )
    for _, block in blocks:
        fully_shard(block, mesh=data_parallel)
    shard_root(module, mesh=data_parallel)
    return [name for name, _ in blocks]


def check_trainable_dtypes(model: nn.Module) -> None:
    """FSDP2 reduce-scatters a unit's gradients in one buffer: every trainable parameter needs one dtype."""
    by_dtype: dict[torch.dtype, list[str]] = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            by_dtype.setdefault(param.dtype, []).append(name)
    if len(by_dtype) > 1:
        shown = "; ".join(f"{dtype}: {', '.join(names[:3])}" for dtype, names in by_dtype.items())
        raise ValueError(
            f"Trainable parameters in {len(by_dtype)} dtypes ({shown}): FSDP2 reduces each unit's gradients in one"
            " buffer. Keep them in one dtype (with a mixed precision, pl_lowprec upcasts the LoRA adapters to fp32)."
        )


def shard_model(model: nn.Module, units: list[tuple[str, nn.Module]], **options: Any) -> None:
    """``fully_shard`` each unit, then the module itself as the root (unless it is a unit). Parameters that are a
    rank's rows (``local_rows``) go in as meta stand-ins and come back after, for FSDP2 to adopt at lazy init."""
    rows = meta_stand_ins(model)
    for _, unit in units:
        fully_shard(unit, **options)
    if all(model is not unit for _, unit in units):
        shard_root(model, **options)
    for module, attr, param in rows:
        setattr(module, attr, param)  # FSDP2 adopts these rows as its shards at lazy init
