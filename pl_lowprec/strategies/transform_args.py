"""``TransformArguments``: the model arguments every strategy takes, declared and documented once.

The first base of each strategy (through ``TransformHooks``), before the Lightning strategy: it takes the
model arguments, builds one ``TransformConfig`` (validated at once) and the ``ModelTransform`` that
applies it, and passes every other argument on to the Lightning strategy with ``super().__init__(**kwargs)``.
jsonargparse follows that ``**kwargs`` through the bases, so ``pl-lowprec fit --help`` lists these arguments
with the help below, and YAML stays flat (``init_args.quantization: nf4-dq``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pl_lowprec.distributed.sharding import Sharding
from pl_lowprec.memory.sizes import parse_bytes
from pl_lowprec.strategies.signature import forwarded_signature, with_shared_arguments
from pl_lowprec.transforms.checkpointing import CheckpointImpl, CheckpointMode, CheckpointPolicy
from pl_lowprec.transforms.config import TransformConfig
from pl_lowprec.transforms.fp8 import FP8Config, FP8Recipe
from pl_lowprec.transforms.memory_saving import MemorySavingPath
from pl_lowprec.transforms.optimizers import OptimizerName
from pl_lowprec.transforms.pipeline import ModelTransform
from pl_lowprec.transforms.qat import QATConfig, QATScheme
from pl_lowprec.transforms.quantization import QuantizationConfig, QuantMode


class TransformArguments:
    """The model arguments shared by every ``pl_lowprec`` strategy.

    Args:
        activation_checkpointing: Blocks to recompute in backward: module classes, class names (YAML), or a
            callable ``(module, name) -> bool``. ``"auto"``: the blocks the model declares (Hugging Face's
            ``_no_split_modules``), checkpointed as ``memory_saving="auto"`` chooses: none, selective, every 2nd
            block or every block, the fastest that fits.
        checkpoint_every_n: Checkpoint only every n-th selected block: less recompute, more memory.
        checkpoint_impl: ``"non_reentrant"`` (default) or ``"reentrant"``.
        checkpoint_mode: ``"full"`` (default) recomputes each checkpointed block whole; ``"selective"`` keeps
            its matmul and attention outputs and recomputes only the cheap ops (norms, activations): more memory
            than ``"full"``, less recompute. Non-reentrant only.
        quantization: Base-weight quantization: ``"nf4"``, ``"nf4-dq"``, ``"fp4"``, ``"fp4-dq"``, ``"int8"``,
            or a ``QuantizationConfig`` (under ``lowprec_fsdp``: ``"nf4"`` or ``"nf4-dq"``, stored as torchao
            NF4 tensors, which shard with their constants).
        lora: LoRA adapters: a ``peft.LoraConfig`` or a dict of its fields (``target_modules`` defaults to
            ``"all-linear"``). Base weights are frozen. To continue a saved adapter: ``pretrained_adapter``.
        optimizer: Swap the configured AdamW for ``"adamw8bit"``, ``"paged_adamw8bit"``,
            ``"paged_adamw32bit"`` or ``"lion8bit"`` (bitsandbytes), or ``"torchao_adamw8bit"`` (torchao's
            8-bit AdamW, which also steps on FSDP2's shards; ``lowprec_fsdp`` takes only this one).
        adapter_only_checkpoint: With ``lora``, checkpoints hold only the trainable weights and the buffers
            (running statistics). ``False``: the whole model, with ``quantization`` the packed base weights and
            their constants, restored as saved.
        pretrained: Weights for a module built on the meta device (in ``configure_model`` under
            ``pl_lowprec.loading.empty_weights()``, or under ``trainer.init_module()``): a ``.safetensors`` file,
            a sharded directory with ``model.safetensors.index.json``, or a Hugging Face model directory. Loaded
            tensor by tensor; layers to be quantized are quantized as they load.
        pretrained_prefix: Turns checkpoint keys into module keys: ``"model."`` prepends to every key (a Hugging
            Face model held as ``self.model``); ``{"model.": "net.model."}`` rewrites a prefix. Not given: the
            keys as they are, or the one prefix under which every key and shape matches (said in one line).
        pretrained_adapter: Continue training a saved peft LoRA adapter (axolotl's ``lora_model_dir``, peft's
            ``PeftModel.from_pretrained(base, dir, is_trainable=True)``): a directory with ``adapter_config.json``
            and ``adapter_model.safetensors`` (``PeftModel.save_pretrained``, ``pl-lowprec export`` without
            ``--merged``), or a hub id (downloaded where there is network). Its own ``LoraConfig`` is used (rank,
            alpha, targets, rsLoRA, DoRA, modules_to_save) and ``lora`` may be left out; values ``lora`` sets beside
            it must agree with the saved ones (``lora_dropout`` may differ). Works with ``quantization``; the base
            (``pretrained``) must be the one the adapter was trained on.
        qat: Quantization-aware training (torchao): ``"int8-dynamic-int4-weight"``, ``"int4-weight-only"``,
            ``"int8-weight-only"``, or a ``QATConfig`` (group size, skipped modules). Converts to the real
            quantized form at the end of fit. Not with ``quantization``.
        fp8: Float8 training of the linear layers (torchao; compute capability 8.9+): ``"tensorwise"``,
            ``"rowwise"``, ``"rowwise_with_gw_hp"``, or an ``FP8Config``. Not with ``quantization`` or ``qat``.
        activation_offloading: Keep saved activations in host memory between forward and backward (CUDA).
        compile: ``torch.compile`` each block (the ``activation_checkpointing`` blocks, the FSDP shard units, or a
            Hugging Face model's decoder layers) after the other transforms, and ``CausalLM``'s loss: ``True``, or
            a dict of ``torch.compile`` arguments (``{"mode": "max-autotune-no-cudagraphs"}``). The first steps
            are slower while it compiles (logged once). On CPU it needs a C++ compiler. Not with
            ``quantization="int8"`` or ``checkpoint_impl="reentrant"``.
        memory_saving: The exact memory-saving paths, which cost time (``pl_lowprec.transforms.memory_saving``):
            ``True`` (default) all, ``False`` none, or a list of ``fused_mlp`` (the LoRA SwiGLU MLP as one
            Function), ``recomputed_norms`` (norms redone row-wise in backward), ``grouped_cross_entropy`` and
            ``chunked_loss`` (the module's loss: ``CausalLM``'s cross-entropy without fp32 logits, and its
            ``loss_chunk_size: auto``). ``"auto"``: before loading, ``fit`` takes the fastest settings whose
            predicted peak fits the device (free CUDA memory, or available host memory, less 10%; or
            ``memory_budget``), turning on the paths, then checkpointing, in that order, and says in one line what
            it chose. Settings given explicitly are kept. The shipped configs use ``"auto"``; the default stays
            ``True`` so that a run built in Python does what ``estimate_memory`` predicts for it.
        memory_budget: Device memory the run may use (``"24GiB"``, ``"80GB"``, bytes): before any weight loads,
            ``fit`` predicts the step's peak (``estimate_memory``, per rank under ``lowprec_fsdp``) and stops when
            it is above, naming the settings ``pl-lowprec plan`` would choose. Keep a margin inside it for the
            CUDA context and fragmentation. ``None`` (default): no check. With ``"auto"`` settings, the memory
            they are chosen for.
    """

    transform_config: TransformConfig
    transform: ModelTransform
    ARGUMENTS_SET_HERE: tuple[str, ...] = ()  # what a strategy passes to its Lightning base itself

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Every strategy (and a user's subclass) shows its whole signature and, in ``help()``, the docs of
        these arguments."""
        super().__init_subclass__(**kwargs)
        cls.__signature__ = forwarded_signature(cls, cls.ARGUMENTS_SET_HERE)
        cls.__doc__ = with_shared_arguments(cls.__dict__.get("__doc__"), TransformArguments.__doc__ or "")

    def __init__(
        self,
        *,
        activation_checkpointing: CheckpointPolicy | Literal["auto"] | None = None,
        checkpoint_every_n: int = 1,
        checkpoint_impl: CheckpointImpl = "non_reentrant",
        checkpoint_mode: CheckpointMode = "full",
        quantization: QuantMode | QuantizationConfig | None = None,
        lora: dict[str, Any] | None = None,
        optimizer: OptimizerName | None = None,
        adapter_only_checkpoint: bool = True,
        pretrained: str | Path | None = None,
        pretrained_prefix: str | dict[str, str] | None = None,
        pretrained_adapter: str | Path | None = None,
        qat: QATScheme | QATConfig | None = None,
        fp8: FP8Recipe | FP8Config | None = None,
        activation_offloading: bool = False,
        compile: bool | dict[str, Any] = False,
        memory_saving: bool | Literal["auto"] | list[MemorySavingPath] = True,
        memory_budget: str | int | None = None,
        **kwargs: Any,
    ) -> None:
        self.transform_config = TransformConfig(
            activation_checkpointing=activation_checkpointing,
            checkpoint_every_n=checkpoint_every_n,
            checkpoint_impl=checkpoint_impl,
            checkpoint_mode=checkpoint_mode,
            quantization=quantization,
            lora=lora,
            optimizer=optimizer,
            adapter_only_checkpoint=adapter_only_checkpoint,
            pretrained=pretrained,
            pretrained_prefix=pretrained_prefix,
            pretrained_adapter=pretrained_adapter,
            qat=qat,
            fp8=fp8,
            activation_offloading=activation_offloading,
            compile=compile,
            memory_saving=memory_saving,
        )
        self.memory_budget = None if memory_budget is None else parse_bytes(memory_budget, "memory_budget")
        super().__init__(**kwargs)
        self.transform = ModelTransform(self.transform_config, self.transform_sharding(self.transform_config))

    def transform_sharding(self, config: TransformConfig) -> Sharding | None:
        """How the transform shards the model: nothing here; the FSDP strategy returns its ``Sharding``."""
        return None
