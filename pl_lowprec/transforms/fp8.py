"""FP8 training of the linear layers (torchao ``Float8Linear``), on GPUs with FP8 tensor cores.

``convert_to_fp8`` swaps the chosen ``nn.Linear`` layers through torchao's ``convert_to_float8_training``: weights
stay in high precision (the optimizer's master copy), and each matmul of forward and backward casts its operands
to float8 with the recipe's scaling. The precision plugin still decides everything around the linear layers
(``AMPPrecision("bf16-mixed")`` is the usual companion).

Why a strategy argument and not a precision plugin: float8 training is a module swap, like quantization and LoRA,
and must run in the one transform path, ordered with them and before the DDP wrapper and the optimizer. As a
precision plugin it would take the Trainer's one precision slot and could not combine with ``AMPPrecision``
(Lightning's Transformer Engine plugin has exactly that limitation).

Real FP8 needs compute capability 8.9 or higher (Ada, Hopper, Blackwell); ``check_fp8_device`` refuses anything
else before training. ``emulate=True`` runs torchao's emulation (the same float8 rounding with high-precision
matmuls) on any device: for tests of the numerics, not for speed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import torch
from torch import nn

from pl_lowprec._checks import CannotRunHere
from pl_lowprec._imports import import_torchao
from pl_lowprec.transforms.linear_filter import DEFAULT_SKIP, is_target_linear

FP8Recipe = Literal["tensorwise", "rowwise", "rowwise_with_gw_hp"]
FP8_RECIPES: tuple[str, ...] = get_args(FP8Recipe)
MIN_CAPABILITY = (8, 9)
FP8_DIM_MULTIPLE = 16  # torch._scaled_mm needs both dimensions of the weight to be multiples of 16


@dataclass(frozen=True)
class FP8Config:
    """Which torchao float8 recipe, on which layers.

    Args:
        recipe: ``"tensorwise"`` (one scale per tensor, fastest), ``"rowwise"`` (one scale per row, more accurate,
            bf16 compute) or ``"rowwise_with_gw_hp"`` (rowwise, weight gradient in high precision: the most
            accurate). torchao's ``Float8LinearConfig.from_recipe_name``.
        skip_modules: Glob patterns of module names left in high precision (default: output heads).
        emulate: Emulate float8 with high-precision matmuls (any device; slow): for testing the numerics.
    """

    recipe: FP8Recipe = "tensorwise"
    skip_modules: Sequence[str] = field(default=DEFAULT_SKIP)
    emulate: bool = False

    def __post_init__(self) -> None:
        if self.recipe not in FP8_RECIPES:
            raise ValueError(
                f"fp8 recipe {self.recipe!r} is not supported. Allowed: {', '.join(map(repr, FP8_RECIPES))}."
            )
        object.__setattr__(self, "skip_modules", tuple(self.skip_modules))

    @classmethod
    def from_recipe(cls, recipe: str, **overrides: Any) -> FP8Config:
        return cls(recipe=recipe, **overrides)  # type: ignore[arg-type]

    def torchao_config(self) -> Any:
        import_torchao()
        from torchao.float8 import Float8LinearConfig

        return dataclasses.replace(Float8LinearConfig.from_recipe_name(self.recipe), emulate=self.emulate)

    def wants(self, module: nn.Module, name: str) -> bool:
        return is_target_linear(module, name, self.skip_modules)


def _uneven(shape: torch.Size) -> bool:
    return any(dim % FP8_DIM_MULTIPLE for dim in shape)


def is_fp8(module: nn.Module) -> bool:
    return type(module).__name__ == "Float8Linear"


def check_fp8_device(device: torch.device, config: FP8Config) -> None:
    """Refuse, before training, a device without FP8 tensor cores (unless emulating)."""
    if config.emulate:
        return
    wanted = f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]}"
    if device.type != "cuda":
        raise CannotRunHere(
            f"fp8={config.recipe!r} needs a CUDA GPU with compute capability {wanted} or higher (Ada, Hopper,"
            f" Blackwell); this Trainer runs on {device.type}. Train on such a GPU, or remove fp8= (use"
            " AMPPrecision('bf16-mixed') instead). FP8Config(emulate=True) checks the numerics anywhere, slowly."
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise CannotRunHere(
            f"fp8={config.recipe!r} needs compute capability {wanted} or higher (Ada, Hopper, Blackwell); found"
            f" {torch.cuda.get_device_name(device)} with compute capability {capability[0]}.{capability[1]}."
            " Remove fp8= and train with AMPPrecision('bf16-mixed') on this GPU."
        )


def convert_to_fp8(model: nn.Module, config: FP8Config) -> list[str]:
    """Swap the chosen linear layers for ``Float8Linear`` (idempotent); return the names swapped.

    Raises ``ValueError`` when nothing is chosen, or when a chosen layer's dimensions are not multiples of 16.
    """
    import_torchao()
    from torchao.float8 import convert_to_float8_training

    if any(is_fp8(m) for m in model.modules()):
        return []
    chosen = {name: m for name, m in model.named_modules() if name and config.wants(m, name)}
    if not chosen:
        raise ValueError(
            f"fp8={config.recipe!r} found no nn.Linear in {type(model).__name__} outside"
            f" skip_modules={list(config.skip_modules)}. Float8 training applies to nn.Linear layers only."
        )
    uneven = [f"{n} {tuple(m.weight.shape)}" for n, m in chosen.items() if _uneven(m.weight.shape)]
    if uneven:
        raise ValueError(
            f"fp8: the float8 matmul needs weight dimensions that are multiples of {FP8_DIM_MULTIPLE}; these are not:"
            f" {', '.join(uneven[:6])}. Add them to skip_modules."
        )
    convert_to_float8_training(model, module_filter_fn=lambda m, n: n in chosen, config=config.torchao_config())
    return sorted(chosen)
