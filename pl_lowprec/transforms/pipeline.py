"""The one place where a model is transformed, in order, shared by every strategy.

What it does, in order: fill a module built on the meta device from ``pretrained=`` safetensors (quantizing
each layer as its weight streams in, ``pl_lowprec.loading``), quantize the base ``nn.Linear`` layers
(bitsandbytes), or fake-quantize them for quantization-aware training, or swap them for float8 training
(torchao), inject LoRA adapters (peft) and prepare them for the precision (under mixed precision, frozen weights
and activations stay in the compute dtype: ``frozen_dtype.py``, ``autocast_activations.py``), then checkpoint
activations, shard (FSDP2) and last compile each block (``compile=``, ``transforms/compiling.py``). During each
training step it may offload saved activations to host memory; at the end of fit it converts a QAT model
to its real quantized form. After ``configure_optimizers`` it may swap the optimizer for a bitsandbytes one.
With LoRA, checkpoints hold only the trainable weights and the buffers.

Where it runs, in ``Trainer._run`` order:

1. ``strategy.connect(model)``, ``setup`` hooks, ``LightningModule.configure_model``;
2. restoring weights from ``ckpt_path`` (``strategy.load_model_state_dict``): **the model transform runs here
   first** when resuming, so an adapter checkpoint loads into a freshly quantized, adapted model;
3. ``strategy.setup``: **the model transform runs here** otherwise, before the precision plugin's
   ``convert_module``, the move to the device, the DDP wrapper and ``configure_optimizers``; **the optimizer
   swap** runs right after ``configure_optimizers``, before the precision plugin connects to the optimizers;
4. restoring optimizer, scheduler and precision state, then the loops.

Under ``strategy="lowprec_fsdp"`` the transform holds a ``Sharding`` (``pl_lowprec.distributed.sharding``), and that is
the one place where a step differs: 4-bit weights are stored as torchao NF4 (which shards) instead of
bitsandbytes, a meta-device module keeps only each rank's rows of every tensor as it is loaded (or, without
``pretrained=``, initialized by its modules' ``reset_parameters``), and the last step shards each unit and the
root with FSDP2.

What to do comes from one ``TransformConfig`` (``transforms/config.py``, validated there); where the
weights come from is ``transforms/weight_sources.py``. Which memory-saving paths run (the fused LoRA MLP, the norms
recomputed in backward, and the module's own loss paths through its ``configure_memory_saving``) is
``memory_saving`` (``transforms/memory_saving.py``). ``"auto"`` settings are chosen by the strategy before this runs
(``memory/fastest.py``); where nothing chose, they mean the memory-saving side.

``apply`` is idempotent, derived from the model itself (quantized layers, LoRA layers and checkpointed blocks
are recognisable), so a second ``fit``, or ``validate`` after ``fit``, changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.optim import Optimizer

from pl_lowprec._imports import import_bitsandbytes, import_torchao
from pl_lowprec.adapters import (
    CheckpointMismatch,
    adapter_checkpoint_state_dict,
    find_base_model,
    load_trainable_state_dict,
    mismatch_summary,
)
from pl_lowprec.distributed.sharding import Sharding
from pl_lowprec.loading import PretrainedWeights, has_meta_tensors
from pl_lowprec.loading.host_memory import release_freed_host_memory
from pl_lowprec.transforms.autocast_activations import keep_activations_in_compute_dtype
from pl_lowprec.transforms.checkpoint_fills import fills_every_weight
from pl_lowprec.transforms.checkpointing import (
    CheckpointPolicy,
    is_checkpointed,
    resolved_blocks,
    set_activation_checkpointing,
)
from pl_lowprec.transforms.checks import refuse_fitting_converted
from pl_lowprec.transforms.compiling import CompileClock, check_compiler, compile_model
from pl_lowprec.transforms.config import TransformConfig
from pl_lowprec.transforms.conv1d import linear_from_conv1d
from pl_lowprec.transforms.dtypes import compute_dtype_of
from pl_lowprec.transforms.fp8 import check_fp8_device, convert_to_fp8
from pl_lowprec.transforms.frozen_dtype import cast_frozen_weights
from pl_lowprec.transforms.fused_lora_mlp import fuse_lora_mlps
from pl_lowprec.transforms.half_trainable import warn_half_trainable
from pl_lowprec.transforms.initial_adapters import keep_initial_adapters, rewrote_the_base_line
from pl_lowprec.transforms.linear_filter import check_skip_modules
from pl_lowprec.transforms.lora import (
    all_linear_against_peft,
    has_lora,
    inject_lora,
    left_tied_to_originals,
    prepare_for_kbit_training,
    trained_copies,
)
from pl_lowprec.transforms.offloading import OffloadActivations, check_offload_device
from pl_lowprec.transforms.optimizers import (
    import_optimizer_library,
    rebind_schedulers,
    swap_line,
    swap_optimizer,
)
from pl_lowprec.transforms.pretrained_adapter import load_adapter_weights, rooted_targets
from pl_lowprec.transforms.qat import convert_qat, is_converted, prepare_qat
from pl_lowprec.transforms.quantization import QuantizationConfig, quantize_linear, quantize_model
from pl_lowprec.transforms.quantized_checkpoint import check_int8_weights, restore_4bit_weights
from pl_lowprec.transforms.tied_linears import check_tied_layers_stay_tied
from pl_lowprec.transforms.trainable import without_lora_line
from pl_lowprec.transforms.trainable_bias import keep_trainable_biases
from pl_lowprec.transforms.weight_sources import (
    fill_meta_model,
    meta_init_context,
    storage_for_the_checkpoint,
    weights_for,
)


class ModelTransform:
    """What a strategy does to the model, as ``config`` says; ``sharding`` under FSDP2 (``lowprec_fsdp``).

    Built with the strategy: the libraries the config needs are imported here, so a missing one fails then,
    not at the first step."""

    def __init__(self, config: TransformConfig, sharding: Sharding | None = None) -> None:
        self.config = config
        self.sharding = sharding
        self.compile_clock = CompileClock()
        if config.quantization is not None and sharding is not None:
            sharding.check_quantization(config.quantization)
        elif config.quantization is not None:
            import_bitsandbytes()
        if config.optimizer is not None:
            import_optimizer_library(config.optimizer)
        if config.qat is not None or config.fp8 is not None:
            import_torchao()

    @property
    def weights(self) -> PretrainedWeights | None:
        """The strategy's ``pretrained=`` source, if any."""
        return self.config.weights

    def apply(
        self,
        model: nn.Module,
        precision_plugin: Any,
        device: torch.device,
        restored_next: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        """Transform ``model`` for training on ``device`` under ``precision_plugin`` (idempotent). ``restored_next``:
        the checkpoint's state dict loaded after it (``ckpt_path=``); where it sets every weight, ``pretrained=`` is
        not read (``checkpoint_fills.py``)."""
        c = self.config
        if hasattr(precision_plugin, "resolve"):  # AMPPrecision("auto") chooses for the device before quantizing
            precision_plugin.resolve(device)
        self.check_device(device)
        if c.qat is not None and is_converted(model):
            refuse_fitting_converted(model)
            return  # converted to its quantized form at the end of fit: the model is final
        compute_dtype = compute_dtype_of(precision_plugin)
        converted = linear_from_conv1d(model)  # GPT-2's Conv1D: a linear layer to quantization, LoRA and FSDP2
        if converted:
            rank_zero_info(
                f"{len(converted)} Conv1D layers (GPT-2's transposed linear layers) taken as nn.Linear: their weights"
                " are transposed as they load and written back in Conv1D's layout by the exports."
            )
        for owner, part in (("QuantizationConfig", c.quantization), ("QATConfig", c.qat), ("FP8Config", c.fp8)):
            if part is not None:
                check_skip_modules(model, part.skip_modules, owner)
        if c.quantization is not None and c.lora is None:  # with lora= the tied weight is frozen like the copy
            check_tied_layers_stay_tied(model, c.quantization)
        if self.sharding is not None:
            self.sharding.check(model, c.quantization)
        streamed = has_meta_tensors(model)  # pretrained= quantizes as it loads
        if not self.storage_for_the_checkpoint(model, device, restored_next):
            self.load_pretrained(model, compute_dtype, device)
        if c.quantization is not None:
            replaced = self.quantize(model, compute_dtype, device)
            if replaced:
                rank_zero_info(f"Quantized {len(replaced)} linear layers to {c.quantization.mode}.")
            if (streamed or replaced) and c.lora is None and c.qat is None and c.fp8 is None:
                rank_zero_info(without_lora_line(model, c.quantization.mode))
        if c.qat is not None:
            faked = prepare_qat(model, c.qat)
            if faked:
                rank_zero_info(f"QAT ({c.qat.scheme}): fake-quantized {len(faked)} linear layers.")
        if c.fp8 is not None:
            swapped = convert_to_fp8(model, c.fp8)
            if swapped:
                rank_zero_info(f"FP8 training ({c.fp8.recipe}) on {len(swapped)} linear layers.")
        if c.lora is not None and not has_lora(model):
            lora = c.lora if c.adapter_directory is None else rooted_targets(c.lora, find_base_model(model)[0])
            adapted = inject_lora(model, lora, c.skip_modules)
            added = prepare_for_kbit_training(model, mixed_precision=precision_plugin_is_mixed(precision_plugin))
            if added:
                rank_zero_info(f"Upcast trainable and norm weights to fp32 for mixed precision (+{added} bytes).")
            keep_trainable_biases(model)  # bitsandbytes would cast them to the compute dtype in place
            if c.adapter_directory is not None:  # after the upcast: the saved fp32 values stay exact
                loaded = self.load_adapter(model)
                rank_zero_info(
                    f"LoRA continues the adapter {str(c.pretrained_adapter)!r}: {loaded} tensors loaded, its config"
                    f" (r={c.lora.r}, lora_alpha={c.lora.lora_alpha}, use_rslora={c.lora.use_rslora},"
                    f" use_dora={c.lora.use_dora})."
                )
            keep_initial_adapters(model)  # PiSSA's, OLoRA's A0 and B0: their adapter export for the original base
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            copies = sorted(trained_copies(model))
            untied = "".join(
                f"; {name}, tied to {copy}, keeps the original rows: peft trains a copy"
                for name, copy in left_tied_to_originals(model).items()
            )
            whole = f", with {', '.join(copies)} trained whole (modules_to_save{untied})" if copies else ""
            moved = rewrote_the_base_line(c.lora)
            unlike_peft = all_linear_against_peft(model, c.lora, c.skip_modules, adapted)
            rank_zero_info(
                f"LoRA on {len(adapted)} layers (r={lora.r}, lora_alpha={lora.lora_alpha}){whole}; {trainable:,}"
                f" trainable parameters.{unlike_peft}{moved}"
            )
            warn_half_trainable(model, precision_plugin.precision)
        if c.lora_in_compute_dtype(precision_plugin_is_mixed(precision_plugin)):
            saved = cast_frozen_weights(model, compute_dtype)
            if saved:
                name = str(compute_dtype).removeprefix("torch.")
                less = f"{saved / 2**20:,.1f} MiB"
                rank_zero_info(f"Frozen weights kept in {name}, the compute dtype: {less} less than in fp32.")
            paths = c.memory_saving_on
            recompute_norms = c.compile_kwargs is None and "recomputed_norms" in paths
            keep_activations_in_compute_dtype(model, recompute_norms=recompute_norms)
            # compile fuses these ops itself; selective checkpointing caches the matmul outputs this overwrites
            fuse = c.compile_kwargs is None and c.checkpoint_mode != "selective" and "fused_mlp" in paths
            if fuse and fuse_lora_mlps(model):
                rank_zero_info("LoRA SwiGLU MLPs fused: gate and up outputs kept, the rest recomputed in backward.")
        configure_memory_saving = getattr(model, "configure_memory_saving", None)
        if callable(configure_memory_saving):  # the module's own paths (CausalLM's loss)
            configure_memory_saving(c.memory_saving_on)
        blocks = checkpointed_blocks(c, model)
        if blocks is not None:
            already = any(is_checkpointed(m) for m in model.modules())
            names = set_activation_checkpointing(
                model, blocks, c.checkpoint_every_n, c.checkpoint_impl, c.checkpoint_mode
            )
            if not already:
                shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
                how = f"{c.checkpoint_impl}, {c.checkpoint_mode}"
                rank_zero_info(f"Activation checkpointing ({how}) on {len(names)} blocks: {shown}")
        if self.sharding is not None:
            units = self.sharding.shard(model)
            if units:
                rank_zero_info(f"FSDP2: {len(units)} shard units and the root across {self.sharding.world_size} ranks.")
            elif self.sharding.world_size == 1:
                rank_zero_info("FSDP2 on one process: the model is not sharded (NF4 weights as they are).")
        if c.compile_kwargs is not None:
            self.compile(model, blocks if self.sharding is None else self.sharding.units)

    def check_device(self, device: torch.device) -> None:
        """Refuse what ``device`` cannot run (float8 matmuls, offloading to pinned host memory, inductor's
        kernels), before anything loads: the strategy asks before the memory search, ``apply`` again."""
        c = self.config
        if c.fp8 is not None:
            check_fp8_device(device, c.fp8)
        if c.activation_offloading:
            check_offload_device(device)
        if c.compile_kwargs is not None:
            self.check_compiler(device)

    def check_compiler(self, device: torch.device) -> None:
        """Refuse ``compile=`` where inductor cannot build kernels, before anything loads."""
        check_compiler(device, self.config.compile_kwargs)

    def compile(self, model: nn.Module, units: CheckpointPolicy | None) -> None:
        """``compile=``: each block, last of all the transforms (``compiling.py``)."""
        compiled = compile_model(model, units, self.config.compile_kwargs)
        if compiled:
            self.compile_clock.started(len(compiled))
            rank_zero_info(
                f"torch.compile on {len(compiled)} blocks ({compiled[0]}, ...); they compile in the first step."
            )

    def after_optimizer_step(self) -> None:
        """Log the compile time once, after the first optimizer step."""
        self.compile_clock.report_once()

    def quantize(self, model: nn.Module, compute_dtype: torch.dtype, device: torch.device) -> list[str]:
        """Base weights to 4/8 bit: bitsandbytes layers, or torchao NF4 weights when sharding (they shard)."""
        if self.sharding is not None:
            return self.sharding.quantize_model(model, self.config.quantization, device)
        return quantize_model(model, self.config.quantization, compute_dtype, device)

    def quantize_layer(
        self, linear: nn.Linear, config: QuantizationConfig, compute_dtype: torch.dtype, device: torch.device
    ) -> nn.Module:
        """One layer as ``pretrained=`` streams it in; the same choice of storage as ``quantize``."""
        if self.sharding is not None:
            return self.sharding.quantize_layer(linear, config, compute_dtype, device)
        return quantize_linear(linear, config, compute_dtype, device)

    def storage_for_the_checkpoint(
        self, model: nn.Module, device: torch.device, restored_next: Mapping[str, torch.Tensor] | None
    ) -> bool:
        """Empty storage in place of ``pretrained=`` where the checkpoint restored next (``restored_next``, its state
        dict) sets every weight of the module (``checkpoint_fills.py``); whether it did so."""
        weights = self.weights_the_checkpoint_replaces(model, restored_next)
        if weights is None:
            return False
        storage_for_the_checkpoint(model, weights, device, self.sharding)
        rank_zero_info(f"pretrained={str(weights.path)!r} is not read: the checkpoint restored holds every weight.")
        return True

    @property
    def new_heads(self) -> tuple[str, ...]:
        """LoRA's ``modules_to_save``: modules the pretrained files may lack (a task's new head), left to their own
        initialization by the load and not counted against a key prefix (``key_match.fitting_index``)."""
        lora = self.config.lora
        return tuple(lora.modules_to_save or ()) if lora is not None else ()

    def weights_the_checkpoint_replaces(
        self, model: nn.Module, restored_next: Mapping[str, torch.Tensor] | None
    ) -> PretrainedWeights | None:
        """The ``pretrained=`` weights of ``model`` (on the meta device, not transformed yet) that the checkpoint
        restored next (its state dict) sets every one of, so that none need be read (``checkpoint_fills.py``);
        ``None`` where there are none or the checkpoint leaves some to them."""
        weights = self.weights_for(model)
        if weights is None or restored_next is None or not fills_every_weight(model, self.config, restored_next):
            return None
        return weights

    def load_pretrained(self, model: nn.Module, compute_dtype: torch.dtype, device: torch.device) -> None:
        """Fill a module built on the meta device (``weight_sources.fill_meta_model``)."""
        weights = self.weights_for(model)
        fill_meta_model(
            model,
            weights,
            self.config.quantization,
            compute_dtype,
            device,
            self.quantize_layer,
            self.sharding,
            self.new_heads,
        )
        if weights is not None:
            release_freed_host_memory()

    def load_adapter(self, model: nn.Module) -> int:
        """``pretrained_adapter=``: the saved tensors into the LoRA just injected (``pretrained_adapter.py``)."""
        c = self.config
        _, base = find_base_model(model)
        source = str(c.pretrained or "") or getattr(getattr(base, "config", None), "_name_or_path", "")
        base_name = f"{type(base).__name__} from {source!r}" if source else type(base).__name__
        return load_adapter_weights(model, c.adapter_directory, c.pretrained_adapter, base_name)

    def weights_for(self, model: nn.Module) -> PretrainedWeights | None:
        """The strategy's ``pretrained=``, else what the module names as its ``pretrained_weights``."""
        return weights_for(model, self.config.weights)

    def tensor_init_context(self, default: AbstractContextManager) -> AbstractContextManager:
        """Under ``trainer.init_module(empty_init=True)`` with ``pretrained=``, parameters go on the meta device."""
        return meta_init_context(default, self.config.weights)

    def offloading(self, model: nn.Module, device: torch.device) -> AbstractContextManager:
        """The context a training step runs in: saved activations to host memory, or nothing."""
        if not self.config.activation_offloading:
            return nullcontext()
        return OffloadActivations(device, exclude=[*model.parameters(), *model.buffers()])

    def on_fit_end(self, model: nn.Module) -> None:
        """Convert a QAT model to its real quantized form (``QATConfig.convert_on_fit_end``); say what compiled after
        the first step."""
        self.compile_clock.report_later()
        if self.config.qat is not None and self.config.qat.convert_on_fit_end and not is_converted(model):
            converted = convert_qat(model, self.config.qat)
            rank_zero_info(f"QAT: converted {len(converted)} linear layers to {self.config.qat.scheme}.")

    def swap_optimizers(self, optimizers: list[Optimizer], lr_scheduler_configs: list[Any], device: torch.device):
        """Replace each optimizer by its bitsandbytes equivalent, re-binding its schedulers."""
        if self.config.optimizer is None:
            return optimizers
        swapped = []
        for old in optimizers:
            new = swap_optimizer(old, self.config.optimizer, device)
            rebind_schedulers(lr_scheduler_configs, old, new)
            rank_zero_info(swap_line(old, new, self.config.optimizer))
            swapped.append(new)
        return swapped

    @property
    def adapter_only(self) -> bool:
        return self.lora is not None and self.config.adapter_only_checkpoint

    def state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        if self.config.qat is not None and is_converted(model):
            return model.state_dict()  # adapters merged into the quantized weights: nothing trains any more
        return adapter_checkpoint_state_dict(model) if self.config.adapter_only else model.state_dict()

    def load_state_dict(self, model: nn.Module, state_dict: Mapping[str, torch.Tensor], strict: bool) -> None:
        """``CheckpointMismatch`` (one paragraph) when the checkpoint's tensors do not fit the model. 4-bit base
        weights saved whole come back with their saved constants (``quantized_checkpoint.py``)."""
        if self.config.quantization is not None and self.config.quantization.mode == "int8":
            check_int8_weights(model, state_dict)
        state_dict = restore_4bit_weights(model, state_dict)
        try:
            if self.config.adapter_only:
                load_trainable_state_dict(model, state_dict, strict=strict)
            else:
                model.load_state_dict(state_dict, strict=strict)
        except RuntimeError as err:  # torch's line per tensor
            raise CheckpointMismatch(mismatch_summary(err)) from err


def checkpointed_blocks(config: TransformConfig, model: nn.Module) -> CheckpointPolicy | None:
    """The blocks to checkpoint; ``activation_checkpointing="auto"`` not chosen yet means every block the model
    declares (the memory-saving side), or none where it declares none."""
    return resolved_blocks(model, config.activation_checkpointing)


def precision_plugin_is_mixed(precision_plugin: Any) -> bool:
    """Whether the plugin computes under autocast (``"16-mixed"``, ``"bf16-mixed"``, ``auto`` resolved to one)."""
    return str(precision_plugin.precision).endswith("-mixed")
