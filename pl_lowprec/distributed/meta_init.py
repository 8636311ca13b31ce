"""A module built on the meta device, made real one module at a time, each rank keeping only its rows.

As each tensor is loaded (``pretrained=``) or initialized (its module's ``reset_parameters``), and quantized if it
is to be, the rank keeps only its own rows, as a DTensor ``local_rows`` (torchtune's
``load_from_full_model_state_dict``: quantize the full weight, then take the chunk, so the constants equal those of
a weight sharded whole). LoRA, k-bit preparation and checkpointing then run on these placeholders;
``meta_stand_ins`` hands FSDP2 meta tensors of the same shapes while it shards, and the rows are put back, which
FSDP2 adopts at its lazy init (``reset_sharded_param``). A rank holds 1/N of the model plus the one tensor being
loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pl_lowprec.distributed.mesh import is_local_rows, local_rows
from pl_lowprec.loading.empty import assert_no_meta, place_own, replace_parameters, reset_on
from pl_lowprec.transforms.quantization import QuantizationConfig, will_quantize

Placement = Callable[[nn.Parameter], nn.Parameter]


def keep_local_rows(mesh: Any) -> Placement:
    """What a rank keeps of each parameter as a meta module is filled, when there are several ranks: its rows
    (``local_rows``), as a parameter of the same ``requires_grad``."""

    def place(param: nn.Parameter) -> nn.Parameter:
        return nn.Parameter(local_rows(param.detach(), mesh), requires_grad=param.requires_grad)

    return place


def initialize_meta_modules(
    model: nn.Module,
    config: QuantizationConfig | None,
    compute_dtype: torch.dtype,
    device: torch.device,
    quantize_layer: Callable[..., nn.Module],
    place: Placement | None,
) -> list[str]:
    """Materialize a module built on the meta device without pretrained weights, one module at a time: its
    parameters made real at full size, set by its own ``reset_parameters()``, quantized if it is to be, and
    only what ``place`` keeps of them kept. Returns the modules initialized."""
    owners = [name for name, m in model.named_modules() if any(p.is_meta for p in m.parameters(recurse=False))]
    check_initializable(model, owners)
    for name in owners:
        module = model.get_submodule(name)
        reset_on(module, device)
        if config is not None and will_quantize(module, name, config):
            parent, _, child = name.rpartition(".")
            module = quantize_layer(module, config, compute_dtype, device)
            setattr(model.get_submodule(parent) if parent else model, child, module)
        if place is not None:
            place_own(module, place)
    assert_no_meta(model)
    return owners


def check_initializable(model: nn.Module, owners: list[str]) -> None:
    """Every module with meta parameters needs ``reset_parameters``, and no parameter may be shared (tied)."""
    modules = {name: model.get_submodule(name) for name in owners}
    lacking = [
        f"{n} ({type(m).__name__})" for n, m in modules.items() if not callable(getattr(m, "reset_parameters", None))
    ]
    seen: dict[int, str] = {}
    tied = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if param.is_meta and id(param) in seen:
            tied.append(f"{seen[id(param)]} = {name}")
        seen.setdefault(id(param), name)
    if lacking or tied:
        why = f"these modules have no reset_parameters(): {', '.join(lacking[:6])}" if lacking else ""
        why += ("; " if why and tied else "") + (f"these parameters are tied: {', '.join(tied[:4])}" if tied else "")
        raise ValueError(
            f"{type(model).__name__} was built on the meta device without pretrained weights, so"
            " strategy='lowprec_fsdp' initializes each module with its own reset_parameters() as it shards it, but"
            f" {why}. Pass pretrained="
            " (a safetensors file or model directory), or build the module with real weights."
        )


def meta_stand_ins(model: nn.Module) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """Swap every ``local_rows`` parameter for a meta tensor of its full shape (``fully_shard`` splits those
    without memory); return the rows to put back once the modules are sharded."""

    def stand_in(rows: nn.Parameter) -> nn.Parameter:  # one for a tied parameter, which FSDP2 shards once
        return nn.Parameter(torch.empty(rows.shape, dtype=rows.dtype, device="meta"), requires_grad=rows.requires_grad)

    return replace_parameters(model, is_local_rows, stand_in)
