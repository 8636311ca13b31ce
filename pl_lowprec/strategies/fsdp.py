"""``LowPrecisionFSDPStrategy``: FSDP2 data-parallel sharding plus the model transform (``"lowprec_fsdp"``).

Built on Lightning's ``ModelParallelStrategy`` (FSDP2), but the user's module needs no ``configure_model``: the
shared ``ModelTransform`` quantizes (torchao NF4, which shards with its constants), injects LoRA, prepares it
for the precision, checkpoints activations and finally shards each unit and the root. Only data parallelism:
the mesh is one dimension over every rank, built on the device type the ranks run on (gloo on CPU, NCCL on CUDA).

Checkpoints are one gathered file (``torch.save`` on rank 0, read by every rank): with LoRA only the adapters
(and their optimizer state), otherwise the full, unquantized model. The hooks that are the same as on one device
(optimizer swap, activation offloading, QAT conversion, teardown) come from ``TransformHooks``; setup (Lightning's
would ask for ``configure_model``), the meta-device init context and checkpoints are this strategy's own.
"""

from __future__ import annotations

from collections.abc import Generator, Mapping
from contextlib import contextmanager, nullcontext
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

from pl_lowprec._hparams import path_globals
from pl_lowprec.distributed.mesh import data_parallel_mesh, is_sharded
from pl_lowprec.distributed.precision import check_precision
from pl_lowprec.distributed.process_group_exit import destroy_process_group_at_exit
from pl_lowprec.distributed.shard import ShardPolicy
from pl_lowprec.distributed.sharding import Sharding
from pl_lowprec.loading import empty_weights
from pl_lowprec.strategies.fsdp_checkpoints import (
    gathered_state_dict,
    load_full_state_dict,
    load_optimizer_states,
    optimizer_state,
)
from pl_lowprec.strategies.optimizer_record import check_same_optimizer
from pl_lowprec.strategies.transform_hooks import TransformHooks
from pl_lowprec.transforms.config import TransformConfig
from pl_lowprec.transforms.lora_options import check_lora_init_on_rows
from pl_lowprec.transforms.nf4 import NF4Layout, ScalerBlockSize
from pl_lowprec.transforms.optimizers import BITSANDBYTES_OPTIMIZERS


class LowPrecisionFSDPStrategy(TransformHooks, ModelParallelStrategy):
    """FSDP2 across every rank, with the model transform (see ``pl_lowprec.transforms.pipeline``).

    Takes the model arguments (listed after its own below), with these limits:
    ``quantization`` is ``"nf4"`` or ``"nf4-dq"`` (torchao NF4, both double-quantize) and needs
    ``adapter_only_checkpoint=True``; ``optimizer`` is ``"torchao_adamw8bit"`` (bitsandbytes' kernels do not
    take DTensors); ``qat`` needs ``convert_on_fit_end=False``.

    Args:
        shard_modules: Blocks that each form a shard unit (classes, class names or a predicate); default: the
            ``activation_checkpointing`` blocks, else (none named, or ``"auto"``) the blocks the model declares
            (Hugging Face's ``_no_split_modules``: its decoder layers), whatever is checkpointed.
        reshard_after_forward: Free each unit's gathered weights after its forward (less memory, one more
            all-gather per unit in backward).
        cpu_offload: Keep sharded parameters, gradients and optimizer state in CPU memory (CUDA only).
        nf4_block_size: Weights per NF4 block (each with its own scale); every quantized weight's rows and
            blocks must split evenly across the ranks (checked before anything loads).
        nf4_scaler_block_size: NF4 scales that share one int8 factor (double quantization). ``"auto"``
            (default): per layer, the largest size that splits across the ranks (256 where it fits), said in one
            INFO line; an integer applies to every layer, and a layer it does not split is an error.
        tensor_parallel_size: Must be 1: this strategy shards data-parallel only.
        process_group_backend: ``"gloo"`` (CPU), ``"nccl"`` (CUDA); ``None`` picks it for the device.
        timeout: Process-group timeout.
    """

    strategy_name = "lowprec_fsdp"
    ARGUMENTS_SET_HERE = ("data_parallel_size", "save_distributed_checkpoint")

    def __init__(
        self,
        shard_modules: ShardPolicy | None = None,
        reshard_after_forward: bool = True,
        cpu_offload: bool = False,
        nf4_block_size: int = 64,
        nf4_scaler_block_size: ScalerBlockSize = "auto",
        tensor_parallel_size: int = 1,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **kwargs: Any,
    ) -> None:
        self._tensor_parallel_request = tensor_parallel_size
        self.sharding = Sharding(
            shard_modules, reshard_after_forward, cpu_offload, NF4Layout(nf4_block_size, nf4_scaler_block_size)
        )
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=False,
            process_group_backend=process_group_backend,
            timeout=timeout,
            **kwargs,
        )
        qat_config = self.transform_config.qat
        if qat_config is not None and qat_config.convert_on_fit_end:
            raise ValueError(
                f"strategy='lowprec_fsdp' got qat={qat_config.scheme!r} with convert_on_fit_end=True: converting"
                " swaps each weight for a torchao quantized tensor, and this strategy does not convert a sharded"
                " model. Pass qat=QATConfig(scheme, convert_on_fit_end=False); after fit, load the adapters"
                " (export_adapter) or a full checkpoint into the model on one device (strategy='lowprec' with the"
                " same qat=) and call pl_lowprec.transforms.qat.convert_qat(model, config)."
            )

    def transform_sharding(self, config: TransformConfig) -> Sharding:
        """Refuse what FSDP2 cannot shard, before any library is imported; shard units default to the
        ``activation_checkpointing`` blocks."""
        check_fsdp_arguments(config, self._tensor_parallel_request)
        if self.sharding.units is None:
            self.sharding.units = config.activation_checkpointing
        return self.sharding

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
        destroy_process_group_at_exit(self)
        self._data_parallel_size, self._tensor_parallel_size = self.world_size, 1
        if self.sharding.cpu_offload and self.root_device.type != "cuda":
            raise ValueError(
                f"cpu_offload=True moves sharded parameters off the GPU; the ranks run on {self.root_device.type},"
                " where they already are in CPU memory. Remove cpu_offload."
            )
        if self.sharding.cpu_offload and self.world_size == 1:
            raise ValueError(
                "cpu_offload=True with one process: nothing is sharded on a mesh of one (torchao's NF4 weights"
                " have no FSDP2 path there), so no FSDP offload policy would manage the parameters and they would"
                " stay in CPU memory while the GPU computes. Run 2 or more processes (Trainer(devices=2)), or on"
                " one GPU use LowPrecisionStrategy, with activation_offloading=True to move activations instead."
            )
        check_lora_init_on_rows(self.transform_config.lora, self.world_size)
        self._device_mesh = data_parallel_mesh(self.root_device.type, self.world_size)
        self.sharding.mesh = self._device_mesh

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def setup(self, trainer: pl.Trainer) -> None:
        """Transform and shard (no ``configure_model`` needed), then the precision and the optimizers."""
        self.before_transform(trainer)
        self.accelerator.setup(trainer)
        self.transform.apply(self.lightning_module, self.precision_plugin, self.root_device)
        if not is_sharded(self.lightning_module):  # one process: no fully_shard moved it to the device
            self.lightning_module.to(self.root_device)
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
        """``empty_init=True`` (or ``pretrained=``) puts parameters on the meta device and keeps buffers real
        (``empty_weights``). Lightning's FSDP2 strategy puts buffers there too, but a rotary embedding's
        ``inv_freq`` is in no checkpoint and only its module's ``__init__`` computes it."""
        meta = empty_weights() if empty_init or self.transform_config.weights is not None else nullcontext()
        with meta, self.precision_plugin.tensor_init_context():
            yield

    # -- checkpoints: one gathered file ------------------------------------------------------------------

    @property
    def lightning_restore_optimizer(self) -> bool:
        return True

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """Lightning's FSDP2 strategy restores after ``setup``, where ``configure_model`` has built and sharded the
        module. This one transforms and shards in ``load_model_state_dict`` itself, so the model is restored before
        ``setup``, as on one device and under DDP: the transform then knows the checkpoint that follows, and where it
        holds every weight ``pretrained=`` is not streamed (``checkpoint_fills.py``). The optimizer states still load
        after ``setup``, into the optimizers it builds."""
        return False

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return gathered_state_dict(self.transform.state_dict(self.lightning_module))

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        return optimizer_state(self.lightning_module, getattr(optimizer, "_optimizer", optimizer))

    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(checkpoint_path))
        with path_globals():  # pathlib paths in the hyperparameters, as TransformHooks.load_checkpoint reads them
            return torch.load(path, map_location="cpu", weights_only=weights_only)

    def load_restored(self, state_dict: Mapping[str, Any], strict: bool) -> None:
        """The gathered checkpoint goes into the shards (``load_full_state_dict``); restored before ``setup``, as
        ``TransformHooks.load_model_state_dict`` runs it."""
        load_full_state_dict(self.lightning_module, state_dict, self.transform_config.adapter_only, strict)

    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        check_same_optimizer(checkpoint, self.optimizers, self.transform_config.optimizer)
        load_optimizer_states(self.lightning_module, self.optimizers, checkpoint["optimizer_states"])

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            description="FSDP2 sharding with NF4 QLoRA and activation checkpointing",
            override=True,
        )


def check_fsdp_arguments(config: TransformConfig, tensor_parallel_size: int) -> None:
    """The model arguments that FSDP2 cannot run, refused when the strategy is built."""
    if tensor_parallel_size != 1:
        what = "4-bit weights cannot be split by tensor parallelism" if config.quantization else "it shards data only"
        raise ValueError(
            f"strategy='lowprec_fsdp' got tensor_parallel_size={tensor_parallel_size!r}: {what}. It shards"
            " parameters, gradients and optimizer state across all ranks (FSDP2); leave tensor_parallel_size=1,"
            " or write the tensor-parallel plan in configure_model with Lightning's ModelParallelStrategy."
        )
    if config.optimizer in BITSANDBYTES_OPTIMIZERS:
        raise ValueError(
            f"strategy='lowprec_fsdp' got optimizer={config.optimizer!r}: bitsandbytes' optimizer kernels are custom"
            " ops that do not take DTensors, and FSDP2's parameters are DTensor shards (the step fails with"
            " 'bitsandbytes.optimizer_update_8bit_blockwise got mixed torch.Tensor and DTensor'). Use"
            " optimizer='torchao_adamw8bit' (torchao.optim.AdamW8bit steps on the shards, 8-bit state as"
            " bitsandbytes'), or strategy='lowprec_ddp' for bitsandbytes' optimizers."
        )
    if config.quantization is not None and not config.adapter_only_checkpoint:
        raise ValueError(
            "strategy='lowprec_fsdp' with quantization= saves adapter-only checkpoints: the NF4 base is rebuilt"
            " from its source at every start. Leave adapter_only_checkpoint=True (and pass lora=)."
        )
