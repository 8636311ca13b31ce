"""``Sharding``: what ``ModelTransform`` holds under ``strategy="lowprec_fsdp"``, a thin shell over this package.

It stores 4-bit base weights as torchao NF4 (``pl_lowprec.transforms.nf4``), the only storage that keeps its
constants through ``fully_shard``; it fills a meta-device module one module at a time, each rank keeping its rows
(``meta_init.py``); and, as the last step of the transform, it shards each unit and then the root (``shard.py``).
The mesh helpers are in ``mesh.py``, which precision plugins run sharded in ``precision.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

from pl_lowprec._imports import import_torchao_nf4
from pl_lowprec.distributed.mesh import empty_local_rows, is_sharded
from pl_lowprec.distributed.meta_init import Placement, initialize_meta_modules, keep_local_rows
from pl_lowprec.distributed.shard import ShardPolicy, check_trainable_dtypes, shard_model, shard_units
from pl_lowprec.transforms.checkpointing import declared_blocks
from pl_lowprec.transforms.nf4 import (
    NF4Layout,
    check_layout,
    check_mode,
    describe_choice,
    nf4_linear,
    quantize_model_nf4,
)
from pl_lowprec.transforms.quantization import QuantizationConfig


@dataclass
class Sharding:
    """How ``ModelTransform`` stores and shards the model under FSDP2; ``mesh`` is set by the strategy once the
    processes exist.

    Args:
        units: Blocks that each form a shard unit: module classes, class names or ``(module, name) -> bool``.
        reshard_after_forward: Free each unit's gathered weights after its forward (less memory, one more
            all-gather in backward).
        cpu_offload: Keep sharded parameters, gradients and optimizer state in CPU memory (CUDA only).
        layout: How NF4 weights are blocked (see ``pl_lowprec.transforms.nf4.NF4Layout``).
    """

    units: ShardPolicy | None = None
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    layout: NF4Layout = field(default_factory=NF4Layout)
    mesh: Any = None

    @property
    def world_size(self) -> int:
        if self.mesh is None:
            raise RuntimeError("The device mesh is built when the processes start (strategy.setup_environment).")
        return self.mesh.size()

    def check_quantization(self, config: QuantizationConfig) -> None:
        """When the strategy is built: a mode that shards, and torchao installed."""
        check_mode(config)
        import_torchao_nf4()

    def check(self, model: nn.Module, config: QuantizationConfig | None) -> None:
        """Everything that can be wrong with the model, before any weight is loaded or quantized."""
        if is_sharded(model):
            return
        units = shard_units(model, self.units)
        if self.units is None:
            kinds = ", ".join(declared_blocks(model))
            rank_zero_info(
                f"FSDP2 shard units: the {len(units)} {kinds} blocks {type(model).__name__} declares (Hugging Face's"
                " _no_split_modules); shard_modules= names others."
            )
        if config is not None:
            scaler_sizes = check_layout(model, config, self.layout, self.world_size)
            if self.layout.is_auto and scaler_sizes:
                rank_zero_info(describe_choice(scaler_sizes, self.world_size))

    def quantize_model(self, model: nn.Module, config: QuantizationConfig, device: torch.device) -> list[str]:
        return quantize_model_nf4(model, config, self.layout, device, self.world_size)

    def quantize_layer(
        self, linear: nn.Linear, config: QuantizationConfig, compute_dtype: torch.dtype, device: torch.device
    ) -> nn.Module:
        """One layer, as ``pretrained=`` streams it in (the signature of ``quantization.quantize_linear``)."""
        return nf4_linear(linear, self.layout, device, self.world_size)

    def placement(self) -> Placement | None:
        """What a rank keeps of each parameter as a meta module is filled: its rows when there are several ranks;
        the whole tensor on one process (``None``), where nothing is sharded."""
        return None if self.world_size == 1 else keep_local_rows(self.mesh)

    def empty_storage(self, device: torch.device) -> Callable[[nn.Parameter], torch.Tensor] | None:
        """The uninitialized storage of a meta parameter that a checkpoint fills next (``empty.storage_to_fill``):
        a rank's rows when there are several ranks, as ``placement`` keeps them; the whole tensor (``None``) on one
        process."""
        return None if self.world_size == 1 else functools.partial(empty_local_rows, mesh=self.mesh, device=device)

    def initialize(
        self,
        model: nn.Module,
        config: QuantizationConfig | None,
        compute_dtype: torch.dtype,
        device: torch.device,
        quantize_layer: Callable[..., nn.Module],
    ) -> list[str]:
        """Materialize a module built on the meta device without pretrained weights, one module at a time, each
        rank keeping its rows (``meta_init.initialize_meta_modules``). Returns the modules initialized."""
        return initialize_meta_modules(model, config, compute_dtype, device, quantize_layer, self.placement())

    def shard(self, model: nn.Module) -> list[str]:
        """``fully_shard`` each unit, then the module itself as the root (idempotent); return the unit names."""
        if is_sharded(model):
            return []
        check_trainable_dtypes(model)
        units = shard_units(model, self.units)
        if self.world_size == 1:
            return []  # one process: nothing to split, and NF4 has no FSDP2 path for a mesh of one
        shard_model(
            model,
            units,
            mesh=self.mesh,
            reshard_after_forward=self.reshard_after_forward,
            offload_policy=CPUOffloadPolicy() if self.cpu_offload else OffloadPolicy(),
        )
        return [name for name, _ in units]
