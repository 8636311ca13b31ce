"""``LowPrecisionFSDPStrategy``: FSDP2 data-parallel sharding plus the model transform (``"lowprec_fsdp"``).

Built on Lightning's ``ModelParallelStrategy`` (FSDP2), but the user's module needs no ``configure_model``: the
shared ``ModelTransform`` quantizes (torchao NF4, which shards with its constants), injects LoRA, prepares it
for the precision, checkpoints activations and finally shards each unit and the root. Only data parallelism:
the mesh is one dimension over every rank, built on the device type the ranks run on (gloo on CPU, NCCL on CUDA).

Checkpoints are one gathered file (``torch.save`` on rank 0, read by every rank): with LoRA only the adapters
(and their optimizer state), otherwise the full, unquantized model.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.strategies.strategy import _StrategyRegistry
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim import Optimizer

from pl_lowprec.checkpointing import CheckpointImpl, CheckpointPolicy
from pl_lowprec.nf4 import NF4Layout
from pl_lowprec.optimizers import OptimizerName
from pl_lowprec.quantization import QuantizationConfig, QuantMode
from pl_lowprec.sharding import Sharding, ShardPolicy, check_precision, data_parallel_mesh
from pl_lowprec.strategies.fsdp_checkpoints import (
    gathered_state_dict,
    load_full_state_dict,
    load_optimizer_states,
    optimizer_state,
)
from pl_lowprec.strategies.transform import ModelTransform, teardown_with_meta


class LowPrecisionFSDPStrategy(ModelParallelStrategy):
    """FSDP2 across every rank, with the model transform (see ``pl_lowprec.strategies.transform``).

    Args:
        activation_checkpointing, checkpoint_every_n, checkpoint_impl, lora, adapter_only_checkpoint,
        pretrained, pretrained_prefix: As for ``LowPrecisionStrategy``.
        quantization: ``"nf4"`` or ``"nf4-dq"`` (or a ``QuantizationConfig`` with one of them): base weights are
            stored as torchao NF4 tensors, which FSDP2 shards with their constants; both double-quantize.
        optimizer: Not supported here yet (bitsandbytes' 8-bit optimizers are untested on sharded parameters).
        shard_modules: Blocks that each form a shard unit (classes, class names or a predicate); default: the
            ``activation_checkpointing`` blocks.
        reshard_after_forward: Free each unit's gathered weights after its forward (less memory, one more
            all-gather per unit in backward).
        cpu_offload: Keep sharded parameters, gradients and optimizer state in CPU memory (CUDA only).
        nf4_block_size, nf4_scaler_block_size: NF4 blocking; every quantized weight's rows, blocks and scale
            groups must split evenly across the ranks (checked before anything loads).
        tensor_parallel_size: Must be 1: this strategy shards data-parallel only.
        process_group_backend: ``"gloo"`` (CPU), ``"nccl"`` (CUDA); ``None`` picks it for the device.
        timeout: Process-group timeout.
    """

    strategy_name = "lowprec_fsdp"

    def __init__(
        self,
        activation_checkpointing: CheckpointPolicy | None = None,
        checkpoint_every_n: int = 1,
        checkpoint_impl: CheckpointImpl = "non_reentrant",
        quantization: QuantMode | QuantizationConfig | None = None,
        lora: dict[str, Any] | None = None,
        optimizer: OptimizerName | None = None,
        adapter_only_checkpoint: bool = True,
        pretrained: str | Path | None = None,
        pretrained_prefix: str | dict[str, str] | None = None,
        shard_modules: ShardPolicy | None = None,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        nf4_block_size: int = 64,
        nf4_scaler_block_size: int = 256,
        tensor_parallel_size: int = 1,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        if tensor_parallel_size != 1:
            what = "4-bit weights cannot be split by tensor parallelism" if quantization else "it shards data only"
            raise ValueError(
                f"strategy='lowprec_fsdp' got tensor_parallel_size={tensor_parallel_size!r}: {what}. It shards"
                " parameters, gradients and optimizer state across all ranks (FSDP2); leave tensor_parallel_size=1,"
                " or write the tensor-parallel plan in configure_model with Lightning's ModelParallelStrategy."
            )
        if optimizer is not None:
            raise ValueError(
                f"strategy='lowprec_fsdp' got optimizer={optimizer!r}: bitsandbytes' 8-bit optimizers are not"
                " supported on FSDP2's sharded parameters here. Use torch.optim.AdamW (its state is sharded anyway)"
                " or strategy='lowprec_ddp'."
            )
        if quantization is not None and not adapter_only_checkpoint:
            raise ValueError(
                "strategy='lowprec_fsdp' with quantization= saves adapter-only checkpoints: the NF4 base is rebuilt"
                " from its source at every start. Leave adapter_only_checkpoint=True (and pass lora=)."
            )
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=False,
            process_group_backend=process_group_backend,
            timeout=timeout,
        )
        self.sharding = Sharding(
            shard_modules if shard_modules is not None else activation_checkpointing,
            reshard_after_forward,
            cpu_offload,
            NF4Layout(nf4_block_size, nf4_scaler_block_size),
        )
        self.transform = ModelTransform(
            activation_checkpointing,
            checkpoint_every_n,
            checkpoint_impl,
            quantization,
            lora,
            None,
            adapter_only_checkpoint,
            pretrained=pretrained,
            pretrained_prefix=pretrained_prefix,
            sharding=self.sharding,
        )

    @property
    def precision_plugin(self) -> Precision:
        return self._precision_plugin if self._precision_plugin is not None else Precision()

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        """The Trainer hands its precision over here, when it is built: refuse what cannot run sharded."""
        if plugin is not None:
            check_precision(plugin)
        self._precision_plugin = plugin

    def setup_environment(self) -> None:
        self._setup_distributed()
        self._data_parallel_size, self._tensor_parallel_size = self.world_size, 1
        if self.sharding.cpu_offload and self.root_device.type != "cuda":
            raise ValueError(
                f"cpu_offload=True moves sharded parameters off the GPU; the ranks run on {self.root_device.type},"
                " where they already are in CPU memory. Remove cpu_offload."
            )
        self._device_mesh = data_parallel_mesh(self.root_device.type, self.world_size)
        self.sharding.mesh = self._device_mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def setup(self, trainer: pl.Trainer) -> None:
        """Transform and shard (no ``configure_model`` needed), then the precision and the optimizers."""
        self.accelerator.setup(trainer)
        self.transform.apply(self.lightning_module, self.precision_plugin, self.root_device)
        # ``LightningModule.device_mesh`` from here on: set earlier, peft would read the module as a
        # tensor-parallel Hugging Face model while injecting LoRA.
        self.lightning_module._device_mesh = self._device_mesh
        self.model = self.precision_plugin.convert_module(self.model)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    @contextmanager
    def tensor_init_context(self, empty_init: bool | None = None) -> Generator[None, None, None]:
        with self.transform.tensor_init_context(super().tensor_init_context(empty_init)):
            yield

    def teardown(self) -> None:
        teardown_with_meta(self, super().teardown)

    # -- checkpoints: one gathered file ------------------------------------------------------------------

    @property
    def lightning_restore_optimizer(self) -> bool:
        return True

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return gathered_state_dict(self.transform.state_dict(self.lightning_module))

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return optimizer_state(self.lightning_module, getattr(optimizer, "_optimizer", optimizer))

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        return torch.load(path, map_location="cpu", weights_only=weights_only)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        load_full_state_dict(self.lightning_module, checkpoint["state_dict"], self.transform.adapter_only, strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        load_optimizer_states(self.lightning_module, self.optimizers, checkpoint["optimizer_states"])

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="FSDP2 sharding with NF4 QLoRA and activation checkpointing",
            override=True,
        )
