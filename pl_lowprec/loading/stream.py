"""Materialize a module built on the meta device from safetensors files, one module's tensors at a time.

As torchtune's ``load_from_full_model_state_dict`` and transformers' loading behind ``from_pretrained`` do,
the model is walked module by module: each tensor is read from its file, cast to the dtype the module
declared for it (what ``load_state_dict`` into that module would give), put on the target device and
assigned. A linear layer that quantization will replace is quantized right away from its loaded weight, so
the full-precision weights never exist all at once. Each file is opened per module and closed again:
safetensors maps the file into memory, and a handle kept open leaves every page it read resident, which
would put the whole checkpoint back into the process's resident memory.

Names and shapes are checked from the file headers before anything is read, and every mismatch is reported
at once.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from pl_lowprec._imports import import_bitsandbytes
from pl_lowprec.loading.empty import assert_no_meta
from pl_lowprec.loading.sources import CheckpointIndex, open_safetensors, resolve_checkpoint
from pl_lowprec.transforms.quantization import (
    QuantizationConfig,
    check_int8_trains,
    quantize_linear,
    share_code_books,
    will_quantize,
)


@dataclass(frozen=True)
class _Slot:
    """One place a tensor lives in the module: ``owner._parameters[attr]`` or ``owner._buffers[attr]``."""

    owner: str
    attr: str
    is_param: bool


@dataclass
class LoadReport:
    source: Path
    tensors: int = 0
    bytes_read: int = 0
    quantized: list[str] = field(default_factory=list)


def _slots(model: nn.Module) -> tuple[dict[str, _Slot], list[list[str]]]:
    """Every state-dict key (parameters, persistent buffers) and the groups of keys that share one tensor."""
    slots: dict[str, _Slot] = {}
    groups: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        tensors = [(a, t, True) for a, t in module._parameters.items()]
        tensors += [(a, t, False) for a, t in module._buffers.items() if a not in module._non_persistent_buffers_set]
        for attr, tensor, is_param in tensors:
            if tensor is None:
                continue
            key = f"{name}.{attr}" if name else attr
            slots[key] = _Slot(name, attr, is_param)
            groups.setdefault(id(tensor), []).append(key)
    return slots, list(groups.values())


def check_against(model: nn.Module, index: CheckpointIndex, prefix: object = None) -> dict[str, str]:
    """For each tensor group, the key to read it from; ``ValueError`` naming every missing, unexpected and
    mis-shaped key."""
    slots, groups = _slots(model)
    state = dict(model.state_dict(keep_vars=True))
    chosen: dict[str, str] = {}
    missing: list[str] = []
    for keys in groups:
        present = [k for k in keys if k in index.tensors]
        if present:
            chosen[keys[0]] = present[0]
        else:
            missing.append(keys[0])
    unexpected = [k for k in index.tensors if k not in slots]
    mis_shaped = [
        f"{k}: checkpoint {list(index.tensors[k].shape)}, module {list(state[k].shape)}"
        for k in chosen.values()
        if tuple(state[k].shape) != index.tensors[k].shape
    ]
    if missing or unexpected or mis_shaped:
        raise ValueError(_mismatch_message(model, index, prefix, missing, unexpected, mis_shaped, list(slots)))
    return chosen


def _shown(keys: list[str], limit: int = 8) -> str:
    return ", ".join(keys[:limit]) + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")


def _mismatch_message(model, index, prefix, missing, unexpected, mis_shaped, module_keys) -> str:
    parts = [f"pretrained={str(index.source)!r} does not fit {type(model).__name__}"]
    if prefix:
        parts[0] += f" (with pretrained_prefix={prefix!r})"
    parts[0] += "; nothing was loaded."
    if missing:
        parts.append(f"Missing from the checkpoint: {_shown(missing)}.")
    if unexpected:
        parts.append(f"In the checkpoint but not in the module: {_shown(unexpected)}.")
    if mis_shaped:
        parts.append(f"Shapes differ: {_shown(mis_shaped, 4)}.")
    hint = _suggest_prefix(module_keys, list(index.tensors))
    if hint and missing and unexpected:
        parts.append(f"The module's keys are the checkpoint's with another prefix: try pretrained_prefix={hint!r}.")
    elif mis_shaped:
        parts.append("Build the module with the checkpoint's config (sizes, vocabulary).")
    return " ".join(parts)


def _suggest_prefix(module_keys: list[str], file_keys: list[str]) -> str | dict[str, str] | None:
    """The prefix that makes most checkpoint keys module keys, if there is one."""
    module_set = set(module_keys)
    candidates: dict[str | tuple[str, str], int] = {}
    for fk in file_keys[:16]:
        for mk in module_keys:
            if mk.endswith("." + fk):
                candidates[mk[: -len(fk)]] = candidates.get(mk[: -len(fk)], 0) + 1
            elif fk.endswith("." + mk):
                pair = (fk[: -len(mk)], "")
                candidates[pair] = candidates.get(pair, 0) + 1
    if not candidates:
        return None
    best = max(candidates, key=candidates.get)
    if isinstance(best, tuple):
        hits = sum(k.removeprefix(best[0]) in module_set for k in file_keys)
        return {best[0]: ""} if hits > len(file_keys) // 2 else None
    hits = sum(best + k in module_set for k in file_keys)
    return best if hits > len(file_keys) // 2 else None


def load_pretrained(
    model: nn.Module,
    source: str | Path,
    prefix: str | Mapping[str, str] | None = None,
    quantization: QuantizationConfig | None = None,
    compute_dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    quantize_layer: Callable[[nn.Linear, QuantizationConfig, torch.dtype, torch.device], nn.Module] = quantize_linear,
    place: Callable[[nn.Parameter], nn.Parameter] | None = None,
) -> LoadReport:
    """Fill every parameter and persistent buffer of ``model`` from ``source``, quantizing on the way.

    Tensors take the dtype the module declared for them. With ``quantization``, each ``nn.Linear`` that
    ``quantize_model`` would replace becomes ``quantize_layer(linear, ...)`` (its bitsandbytes layer by default;
    torchao NF4 under FSDP) as soon as its weight is loaded. ``place`` turns each loaded parameter into what the
    module keeps (under FSDP: this rank's rows only), right after it is loaded, or after its layer is quantized.
    """
    device = torch.device(device)
    index = resolve_checkpoint(source, prefix)
    chosen = check_against(model, index, prefix)
    if quantization is not None and not quantization.is_4bit:
        check_int8_trains(import_bitsandbytes(), device)
    slots, groups = _slots(model)
    aliases = {keys[0]: keys for keys in groups}
    by_owner: dict[str, list[str]] = {}
    for first in chosen:
        by_owner.setdefault(slots[first].owner, []).append(first)
    report = LoadReport(index.source)
    # Names, not modules: a list of modules would keep every replaced layer's full-precision weight alive.
    for owner_name in [name for name, _ in model.named_modules()]:
        owner = model.get_submodule(owner_name)
        quantizing = quantization is not None and will_quantize(owner, owner_name, quantization)
        firsts = by_owner.get(owner_name, [])
        for file, keys in _by_file(firsts, chosen, index).items():
            with open_safetensors(file, device="cpu") as handle:
                for first in keys:
                    declared = _current(model, slots[first])
                    loaded = handle.get_tensor(index.tensors[chosen[first]].key)
                    report.bytes_read += loaded.numel() * loaded.element_size()
                    tensor = loaded.to(device=device, dtype=declared.dtype)
                    del loaded
                    is_param = slots[first].is_param
                    value = nn.Parameter(tensor, requires_grad=declared.requires_grad) if is_param else tensor
                    if is_param and place is not None and not quantizing:
                        value = place(value)
                    for key in aliases[first]:  # tied weights stay one tensor
                        _assign(model, slots[key], value)
                    report.tensors += 1
        if quantizing:
            parent_name, _, child = owner_name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            layer = quantize_layer(owner, quantization, compute_dtype, device)
            if place is not None:
                for attr, param in layer.named_parameters(recurse=False):
                    layer._parameters[attr] = place(param)
            setattr(parent, child, layer)
            report.quantized.append(owner_name)
            del layer
        del owner
    if report.quantized:
        share_code_books(model)
    assert_no_meta(model)
    mode = f"; quantized {len(report.quantized)} linear layers to {quantization.mode}" if quantization else ""
    rank_zero_info(f"Loaded {report.tensors} tensors ({report.bytes_read / 2**20:.1f} MiB) from {index.source}{mode}.")
    return report


def _by_file(firsts: list[str], chosen: dict[str, str], index: CheckpointIndex) -> dict[Path, list[str]]:
    grouped: dict[Path, list[str]] = {}
    for first in firsts:
        grouped.setdefault(index.tensors[chosen[first]].file, []).append(first)
    return grouped


def _current(model: nn.Module, slot: _Slot) -> torch.Tensor:
    owner = model.get_submodule(slot.owner) if slot.owner else model
    return (owner._parameters if slot.is_param else owner._buffers)[slot.attr]


def _assign(model: nn.Module, slot: _Slot, value: torch.Tensor) -> None:
    owner = model.get_submodule(slot.owner) if slot.owner else model
    (owner._parameters if slot.is_param else owner._buffers)[slot.attr] = value
