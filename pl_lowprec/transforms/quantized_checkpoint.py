"""A whole checkpoint's 4-bit base weights (``adapter_only_checkpoint=False`` with ``quantization=``) restored as saved.

bitsandbytes' ``Linear4bit._save_to_state_dict`` writes each packed weight with its quantization constants beside
it: ``weight.absmax``, ``weight.quant_map``, with double quantization ``weight.nested_absmax`` and
``weight.nested_quant_map``, and the rest packed in ``weight.quant_state.bitsandbytes__nf4`` (or ``__fp4``). Those
keys are no module's parameters or buffers, so torch's ``load_state_dict`` refused them as unexpected, and a QLoRA
run saved whole could not be resumed or validated. They are taken out here and each layer's weight is rebuilt from
the saved bytes and constants with ``Params4bit.from_prequantized``, as transformers restores a saved 4-bit model
(its ``Bnb4bitDeserialize``): the base the adapters were trained on, exactly, whatever ``pretrained=`` holds now.
8-bit layers load themselves: ``Linear8bitLt._load_from_state_dict`` reads its ``SCB`` and ``weight_format``;
but a weight saved unquantized (a run without ``quantization="int8"``) would be cast into the int8 storage and
scaled by an ``SCB`` computed from whatever the layer held: ``check_int8_weights`` refuses it.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from pl_lowprec._imports import import_bitsandbytes
from pl_lowprec.adapters import CheckpointMismatch
from pl_lowprec.transforms.quantization import share_code_books

PACKED_STATE = "quant_state.bitsandbytes__"  # the key whose tensor packs quant_type, blocksize, dtype, shape, ...
# what Linear4bit saves beside ``weight`` (transformers' ``Bnb4BitHfQuantizer.serialized_names``)
SAVED_BESIDE = ("absmax", "quant_map", "nested_absmax", "nested_quant_map", f"{PACKED_STATE}nf4", f"{PACKED_STATE}fp4")


def restore_4bit_weights(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rebuild every ``Linear4bit`` weight of ``model`` that ``state_dict`` saved with its constants; return the
    state dict left for torch's ``load_state_dict``. ``CheckpointMismatch`` where a saved weight is not the
    layer's: another shape, 4-bit type or double quantization, or packed bytes saved without their constants."""
    rest = dict(state_dict)
    if not any(type(module).__name__ == "Linear4bit" for module in model.modules()):
        return rest
    bnb = import_bitsandbytes()
    restored = False
    for name, module in model.named_modules():
        if not isinstance(module, bnb.nn.Linear4bit):
            continue
        key = f"{name}.weight" if name else "weight"
        if key not in rest:  # torch's load_state_dict names what is missing or unexpected
            continue
        stats = {part: rest.pop(f"{key}.{part}") for part in SAVED_BESIDE if f"{key}.{part}" in rest}
        if not stats:
            check_not_packed(key, rest[key], module.weight)
            continue
        built = module.weight.quant_state
        saved = bnb.nn.Params4bit.from_prequantized(
            rest[key], stats, requires_grad=False, device=module.weight.device, module=module
        )
        check_same_layer(key, saved.quant_state, built)
        module.weight = saved
        rest[key] = saved  # torch's copy_ of the packed bytes then copies the tensor onto itself: nothing
        restored = True
    if restored:
        share_code_books(model)  # the saved code books are one copy per layer again
    return rest


def check_same_layer(key: str, saved: object, built: object) -> None:
    """The saved weight must be the one this config builds: its logical shape, 4-bit type and double quantization."""
    for what in ("shape", "quant_type", "nested"):
        was, now = getattr(saved, what), getattr(built, what)
        if was != now:
            raise CheckpointMismatch(f"the 4-bit weight {key} has {what} {was} in the checkpoint, {now} in the model")


def check_not_packed(key: str, saved: torch.Tensor, built: torch.Tensor) -> None:
    """Packed bytes without their constants would be copied in and read with the constants the layer computed from
    what it held (the empty storage a whole checkpoint fills, or ``pretrained=``); a weight saved unquantized has
    another shape, which torch's ``load_state_dict`` names."""
    if saved.shape == built.shape and saved.dtype == built.dtype:
        raise CheckpointMismatch(
            f"the 4-bit weight {key} is in the checkpoint without the constants saved beside it"
            f" ({', '.join(f'{key}.{part}' for part in SAVED_BESIDE[:2])}, ...)"
        )


def check_int8_weights(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> None:
    """``CheckpointMismatch`` where an int8 layer's saved weight is not int8 with its ``SCB``: torch's copy would
    cast it into the layer silently, next to the ``SCB`` of what the layer held before (nothing, or the base)."""
    bnb = import_bitsandbytes()
    for name, module in model.named_modules():
        key = f"{name}.weight" if name else "weight"
        if not isinstance(module, bnb.nn.Linear8bitLt) or key not in state_dict:
            continue
        saved = state_dict[key]
        scb = f"{name}.SCB" if name else "SCB"
        if saved.dtype != torch.int8 or scb not in state_dict:
            raise CheckpointMismatch(
                f"the int8 layer {name} has a {str(saved.dtype).removeprefix('torch.')} weight"
                f"{'' if scb in state_dict else ' and no SCB'} in the checkpoint, saved without quantization='int8'"
            )
