"""``TransformConfig``: the strategies' model arguments as one frozen, validated value.

Every strategy (``pl_lowprec.strategies.transform_args.TransformArguments``), ``ModelTransform`` and
``estimate_memory`` take this one config, so an argument is declared, documented and checked in one place.
Short names are normalised when it is built (``quantization="nf4-dq"`` becomes a ``QuantizationConfig``,
``lora={"r": 8}`` a ``peft.LoraConfig`` (``pretrained_adapter=`` the one its directory saved), ``compile=True``
the arguments of ``torch.compile``), and a bad value
or combination is refused before any step runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from pl_lowprec.loading import PretrainedWeights
from pl_lowprec.transforms.checkpointing import (
    CheckpointImpl,
    CheckpointMode,
    CheckpointPolicy,
    validate_checkpoint_args,
)
from pl_lowprec.transforms.checks import check_linear_transforms
from pl_lowprec.transforms.compiling import CompileArg, check_compile_combination, compile_options
from pl_lowprec.transforms.fp8 import FP8Config, FP8Recipe
from pl_lowprec.transforms.linear_filter import DEFAULT_SKIP
from pl_lowprec.transforms.lora import lora_config
from pl_lowprec.transforms.lora_options import check_lora_options
from pl_lowprec.transforms.memory_saving import ALL_PATHS, AUTO, MemorySavingArg, memory_saving_paths
from pl_lowprec.transforms.optimizers import OptimizerName, validate_optimizer_name
from pl_lowprec.transforms.pretrained_adapter import adapter_lora_config, resolve_adapter
from pl_lowprec.transforms.qat import QATConfig, QATScheme
from pl_lowprec.transforms.quantization import QuantizationConfig, QuantMode


def linear_config(argument: str, value: Any, cls: type) -> Any:
    """``value`` as given (a name, a ``cls``, ``None``), or a dict of ``cls``'s fields (as ``lora=`` takes one) built
    into a ``cls``; anything else is refused naming what the argument takes (it failed later in an
    ``AttributeError``)."""
    if value is None or isinstance(value, (str, cls)):
        return value
    name = cls.__name__
    if not isinstance(value, Mapping):
        raise TypeError(
            f"{argument}= takes a mode name, a {name} or a dict of its fields, got {type(value).__name__} ({value!r})."
        )
    allowed = [f.name for f in fields(cls)]
    unknown = [key for key in value if key not in allowed]
    if unknown:
        raise ValueError(
            f"{argument}={dict(value)!r}: {', '.join(map(repr, unknown))} is no field of {name}. Its fields:"
            f" {', '.join(allowed)}."
        )
    try:
        return cls(**value)
    except TypeError as err:  # a required field left out
        raise ValueError(
            f"{argument}={dict(value)!r} is not a valid {name}: {err}. Its fields: {', '.join(allowed)}."
        ) from err


@dataclass(frozen=True)
class TransformConfig:
    """What happens to the model; the fields are the strategies' model arguments (documented on
    ``TransformArguments``). After ``__post_init__``, ``quantization``, ``qat`` and ``fp8`` are configs (or
    ``None``), ``lora`` is a ``peft.LoraConfig`` (or ``None``) and ``weights`` says where ``pretrained=`` points."""

    activation_checkpointing: CheckpointPolicy | Literal["auto"] | None = None
    checkpoint_every_n: int = 1
    checkpoint_impl: CheckpointImpl = "non_reentrant"
    checkpoint_mode: CheckpointMode = "full"
    quantization: QuantMode | QuantizationConfig | None = None
    lora: Mapping[str, Any] | Any | None = None
    optimizer: OptimizerName | None = None
    adapter_only_checkpoint: bool = True
    pretrained: str | Path | None = None
    pretrained_prefix: str | Mapping[str, str] | None = None
    pretrained_adapter: str | Path | None = None
    qat: QATScheme | QATConfig | None = None
    fp8: FP8Recipe | FP8Config | None = None
    activation_offloading: bool = False
    compile: CompileArg = False
    memory_saving: MemorySavingArg = True
    weights: PretrainedWeights | None = field(init=False, default=None, repr=False, compare=False)
    compile_kwargs: dict[str, Any] | None = field(init=False, default=None, repr=False, compare=False)
    adapter_directory: Path | None = field(init=False, default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        validate_checkpoint_args(self.checkpoint_every_n, self.checkpoint_impl, self.checkpoint_mode)
        object.__setattr__(self, "memory_saving", memory_saving_paths(self.memory_saving))
        if self.activation_checkpointing == AUTO and (self.checkpoint_every_n != 1 or self.checkpoint_mode != "full"):
            raise ValueError(
                f"activation_checkpointing='auto' with checkpoint_every_n={self.checkpoint_every_n} and"
                f" checkpoint_mode={self.checkpoint_mode!r}: 'auto' chooses those itself (none, selective, every 2nd"
                " block or every block of the blocks the model declares). Name the blocks (activation_checkpointing:"
                " [LlamaDecoderLayer]) to set them, or leave them at their defaults (1, 'full')."
            )
        if self.checkpoint_every_n != 1 and self.activation_checkpointing is None:
            raise ValueError(
                f"checkpoint_every_n={self.checkpoint_every_n} was given without activation_checkpointing=: it says"
                " which of the checkpointed blocks to checkpoint, and none are named, so nothing would be. Pass"
                " activation_checkpointing= (e.g. the decoder layer class), or leave checkpoint_every_n at 1."
            )
        if self.checkpoint_mode != "full" and self.activation_checkpointing is None:
            raise ValueError(
                f"checkpoint_mode={self.checkpoint_mode!r} was given without activation_checkpointing=: it says what"
                " to keep inside the checkpointed blocks, and none are named. Pass activation_checkpointing= (e.g. the"
                " decoder layer class), or leave checkpoint_mode at 'full'."
            )
        if self.pretrained_prefix is not None and self.pretrained is None:
            raise ValueError(f"pretrained_prefix={self.pretrained_prefix!r} was given without pretrained=.")
        if self.pretrained:
            object.__setattr__(self, "weights", PretrainedWeights(self.pretrained, self.pretrained_prefix))
        object.__setattr__(self, "quantization", linear_config("quantization", self.quantization, QuantizationConfig))
        object.__setattr__(self, "qat", linear_config("qat", self.qat, QATConfig))
        object.__setattr__(self, "fp8", linear_config("fp8", self.fp8, FP8Config))
        if isinstance(self.quantization, str):
            object.__setattr__(self, "quantization", QuantizationConfig.from_mode(self.quantization))
        if self.optimizer is not None:
            validate_optimizer_name(self.optimizer)
        if self.pretrained_adapter is not None:
            directory = resolve_adapter(self.pretrained_adapter)
            object.__setattr__(self, "adapter_directory", directory)
            object.__setattr__(self, "lora", adapter_lora_config(directory, self.lora, self.pretrained_adapter))
        if self.lora is not None:
            object.__setattr__(self, "lora", lora_config(self.lora))
            check_lora_options(self.lora, self.quantization.mode if self.quantization is not None else None)
        if isinstance(self.qat, str):
            object.__setattr__(self, "qat", QATConfig.from_scheme(self.qat))
        if isinstance(self.fp8, str):
            object.__setattr__(self, "fp8", FP8Config.from_recipe(self.fp8))
        check_linear_transforms(self.quantization, self.qat, self.fp8)
        if not isinstance(self.activation_offloading, bool):
            raise TypeError(f"activation_offloading takes True or False, got {self.activation_offloading!r}.")
        object.__setattr__(self, "compile_kwargs", compile_options(self.compile))
        mode = self.quantization.mode if self.quantization is not None else None
        check_compile_combination(self.compile_kwargs, self.checkpoint_impl, mode)

    @property
    def skip_modules(self) -> tuple[str, ...]:
        """The layers LoRA leaves alone: quantization's ``skip_modules``, else the output heads."""
        return tuple(self.quantization.skip_modules) if self.quantization is not None else DEFAULT_SKIP

    @property
    def memory_saving_on(self) -> frozenset[str]:
        """The memory-saving paths that are on: ``memory_saving="auto"`` not chosen yet means all of them."""
        return ALL_PATHS if self.memory_saving == AUTO else self.memory_saving

    def lora_in_compute_dtype(self, mixed_precision: bool) -> bool:
        """Whether frozen weights and activations stay in the compute dtype (``frozen_dtype.py``,
        ``autocast_activations.py``), where the fused LoRA MLP and the recomputed norms can apply: LoRA under mixed
        precision, without QAT or fp8."""
        return self.lora is not None and self.qat is None and self.fp8 is None and mixed_precision

    @property
    def chooses_automatically(self) -> bool:
        """Whether a setting is ``"auto"``, for the strategy to choose before loading (``memory/fastest.py``)."""
        return AUTO in (self.memory_saving, self.activation_checkpointing)

    @property
    def adapter_only(self) -> bool:
        """Whether checkpoints hold only the trainable (adapter) weights and the buffers."""
        return self.lora is not None and self.adapter_only_checkpoint
