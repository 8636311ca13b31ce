"""Materialize a module built on the meta device from safetensors (or mapped torch .bin) files, one module's tensors
at a time.

As torchtune's ``load_from_full_model_state_dict`` and transformers' loading behind ``from_pretrained`` do,
the model is walked module by module: each tensor is read from its file, cast to the dtype the module
declared for it (what ``load_state_dict`` into that module would give), put on the target device and
assigned. A linear layer that quantization will replace is quantized right away from its loaded weight, so
the full-precision weights never exist all at once. A safetensors file is opened per module and closed again:
it maps the file into memory, and a handle kept open leaves every page it read resident, which would put the
whole checkpoint back into the process's resident memory. A ``.bin`` is unpickled once per load (tens of
milliseconds a time) and kept mapped (``sources.WeightFiles``); each module's tensors are dropped from its
resident pages once consumed, to the same effect.
A tensor that keeps its stored dtype on the CPU is the mapping itself (as ``from_pretrained``'s are): its pages
are the page cache's, and a checkpoint file rewritten in place while the model lives changes the weights not yet
trained.

Names and shapes are checked from the file headers before anything is read, and every mismatch is reported
at once (``key_match.py``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from pl_lowprec._imports import import_bitsandbytes
from pl_lowprec.loading.empty import assert_no_meta, place_own, reset_on
from pl_lowprec.loading.key_match import Prefix, Slot, fitting_index, slots
from pl_lowprec.loading.sources import CheckpointIndex, TensorInfo, weight_files
from pl_lowprec.transforms.conv1d import stored_transposed
from pl_lowprec.transforms.quantization import (
    QuantizationConfig,
    check_int8_trains,
    quantize_linear,
    share_code_books,
    will_quantize,
)


@dataclass
class LoadReport:
    source: Path
    prefix: Prefix  # the pretrained_prefix the keys were read with: the one given, or the one taken (key_match.py)
    tensors: int = 0
    bytes_read: int = 0
    quantized: list[str] = field(default_factory=list)
    casts: Counter[tuple[torch.dtype, torch.dtype]] = field(default_factory=Counter)  # (stored, loaded): tensors

    def dtypes_line(self) -> str:
        """What dtype the tensors were stored in and which the module took them in: a cast is said, never silent."""
        changed = {pair: n for pair, n in self.casts.items() if pair[0] != pair[1]}
        if not changed:
            kept = sorted({_short(stored) for stored, _ in self.casts})
            return f", in {'/'.join(kept)} as stored" if kept else ""
        shown = "; ".join(f"{n} from {_short(a)} to {_short(b)}" for (a, b), n in sorted(changed.items(), key=str))
        return f", cast to the dtypes the module declares ({shown})"


def load_pretrained(
    model: nn.Module,
    source: str | Path,
    prefix: Prefix = None,
    quantization: QuantizationConfig | None = None,
    compute_dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    quantize_layer: Callable[[nn.Linear, QuantizationConfig, torch.dtype, torch.device], nn.Module] = quantize_linear,
    place: Callable[[nn.Parameter], nn.Parameter] | None = None,
    new_heads: tuple[str, ...] = (),
    expected_prefix: str | None = None,
) -> LoadReport:
    """Fill every parameter and persistent buffer of ``model`` from ``source``, quantizing on the way.

    Tensors take the dtype the module declared for them. With ``quantization``, each ``nn.Linear`` that
    ``quantize_model`` would replace becomes ``quantize_layer(linear, ...)`` (its bitsandbytes layer by default;
    torchao NF4 under FSDP) as soon as its weight is loaded. ``place`` turns each loaded parameter into what the
    module keeps (under FSDP: this rank's rows only), right after it is loaded, or after its layer is quantized.
    ``new_heads`` (LoRA's ``modules_to_save``) may be absent from the checkpoint: they start from their module's
    ``reset_parameters``, and a head of the checkpoint that the module lacks is left unread (``key_match.py``).
    ``expected_prefix`` (without ``prefix``): the prefix tried first (``key_match.fitting_index``).
    """
    device = torch.device(device)
    with weight_files() as files:  # a .bin shard is unpickled once for the whole load (or the export around it)
        index, match, prefix = fitting_index(model, source, prefix, new_heads, expected_prefix, files=files)
        chosen = match.chosen
        if quantization is not None and not quantization.is_4bit:
            check_int8_trains(import_bitsandbytes(), device)
        module_slots, groups = slots(model)
        aliases = {keys[0]: keys for keys in groups}
        by_owner: dict[str, list[str]] = {}
        for first in chosen:
            by_owner.setdefault(module_slots[first].owner, []).append(first)
        report = LoadReport(index.source, prefix)
        # Names, not modules: a list of modules would keep every replaced layer's full-precision weight alive.
        for owner_name in [name for name, _ in model.named_modules()]:
            owner = model.get_submodule(owner_name)
            quantizing = quantization is not None and will_quantize(owner, owner_name, quantization)
            firsts = by_owner.get(owner_name, [])
            read = _by_file(firsts, chosen, index)
            for file, keys in read.items():
                with files.open(file, device="cpu") as handle:
                    for first in keys:
                        declared = _current(model, module_slots[first])
                        loaded = handle.get_tensor(index.tensors[chosen[first]].key)
                        report.bytes_read += loaded.numel() * loaded.element_size()
                        if stored_transposed(owner, module_slots[first].attr):  # a Conv1D's [in, out] weight
                            loaded = loaded.T.contiguous()
                        tensor = loaded.to(device=device, dtype=declared.dtype)
                        is_param = module_slots[first].is_param
                        if is_param:
                            check_finite(tensor, loaded, index.tensors[chosen[first]])
                        report.casts[(loaded.dtype, tensor.dtype)] += 1
                        del loaded
                        value = nn.Parameter(tensor, requires_grad=declared.requires_grad) if is_param else tensor
                        if is_param and place is not None and not quantizing:
                            value = place(value)
                        for key in aliases[first]:  # tied weights stay one tensor
                            _assign(model, module_slots[key], value)
                        report.tensors += 1
            if quantizing:
                parent_name, _, child = owner_name.rpartition(".")
                parent = model.get_submodule(parent_name) if parent_name else model
                layer = quantize_layer(owner, quantization, compute_dtype, device)
                if place is not None:
                    place_own(layer, place)
                setattr(parent, child, layer)
                report.quantized.append(owner_name)
                del layer
            for file, keys in read.items():  # consumed: copied, quantized, or kept as the mapping (read again if used)
                for first in keys:
                    files.release(file, index.tensors[chosen[first]].key)
            del owner
    if report.quantized:
        share_code_books(model)
    _initialize_fresh(model, match.fresh, module_slots, device, place)
    if match.fresh or match.unused:
        unused = f"; of the checkpoint, {', '.join(match.unused)} not used" if match.unused else ""
        rank_zero_info(
            f"pretrained={str(index.source)!r}: {', '.join(match.fresh)} not in the checkpoint, a new head that trains"
            f" whole (modules_to_save): initialized by its module's reset_parameters{unused}."
        )
    if match.computed:
        rank_zero_info(
            f"pretrained={str(index.source)!r}: {len(match.computed)} tensor(s) left unread, copies of buffers the"
            f" module computes itself ({match.computed[0]}, ...), which older transformers saved; from_pretrained"
            " leaves them unread too."
        )
    assert_no_meta(model)
    mode = f"; quantized {len(report.quantized)} linear layers to {quantization.mode}" if quantization else ""
    size = f"{report.bytes_read / 2**20:.1f} MiB"
    rank_zero_info(f"Loaded {report.tensors} tensors ({size}) from {index.source}{report.dtypes_line()}{mode}.")
    return report


def check_finite(tensor: torch.Tensor, stored: torch.Tensor, info: TensorInfo) -> None:
    """Refuse a parameter with inf or NaN: stored so (a corrupt file), or made so by the cast to the module's dtype
    (bfloat16 or float32 values past float16's 65504), which would otherwise train on inf without a word."""
    if not tensor.is_floating_point() or all_finite(tensor):
        return
    where = f"{info.key!r} in {info.file}"
    if all_finite(stored):
        largest = float(stored.abs().max())
        raise ValueError(
            f"Checkpoint tensor {where} holds values up to {largest:.4g}, past {_short(tensor.dtype)}'s range, and"
            f" became inf when cast from {_short(stored.dtype)} to {_short(tensor.dtype)}, the dtype the module"
            " declares. Load it in bfloat16 or float32: precision='bf16-true' or 'bf16-mixed' instead of '16-true',"
            " or CausalLM(dtype='bfloat16')."
        )
    bad = int((~torch.isfinite(stored)).sum())
    raise ValueError(
        f"Checkpoint tensor {where} holds {bad:,} inf or NaN values in the file itself: the checkpoint is damaged"
        " or was saved after a diverged step. Use another copy or an earlier checkpoint."
    )


FINITE_CHECK_SLICE = 1 << 22  # elements looked at together where the sum is not finite: a 4 MiB mask


def all_finite(tensor: torch.Tensor) -> bool:
    """No inf or NaN, told by one sum in the tensor's own dtype, which allocates nothing (``sum(dtype=float32)``
    of a bfloat16 tensor copies it to float32, and ``isfinite`` builds a tensor-sized ``abs`` and mask: an 8B
    model's embedding would need 2 GB more for either); only a non-finite sum, which finite values rarely reach,
    is looked at element by element, in slices of ``FINITE_CHECK_SLICE`` elements."""
    if bool(torch.isfinite(tensor.sum())):
        return True
    return all(bool(torch.isfinite(part).all()) for part in tensor.reshape(-1).split(FINITE_CHECK_SLICE))


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _initialize_fresh(
    model: nn.Module,
    fresh: list[str],
    module_slots: dict[str, Slot],
    device: torch.device,
    place: Callable[[nn.Parameter], nn.Parameter] | None,
) -> None:
    """The new heads' tensors, which no checkpoint holds, made real and initialized as their module does."""
    for owner_name in sorted({module_slots[key].owner for key in fresh}):
        owner = model.get_submodule(owner_name)
        if not callable(getattr(owner, "reset_parameters", None)):
            raise ValueError(
                f"{owner_name} ({type(owner).__name__}) is a new head, in no checkpoint, and has no reset_parameters()"
                " to initialize it: build it with weights, or leave it out of modules_to_save."
            )
        reset_on(owner, device)
        if place is not None:
            place_own(owner, place)


def _by_file(firsts: list[str], chosen: dict[str, str], index: CheckpointIndex) -> dict[Path, list[str]]:
    grouped: dict[Path, list[str]] = {}
    for first in firsts:
        grouped.setdefault(index.tensors[chosen[first]].file, []).append(first)
    return grouped


def _current(model: nn.Module, slot: Slot) -> torch.Tensor:
    owner = model.get_submodule(slot.owner) if slot.owner else model
    return (owner._parameters if slot.is_param else owner._buffers)[slot.attr]


def _assign(model: nn.Module, slot: Slot, value: torch.Tensor) -> None:
    owner = model.get_submodule(slot.owner) if slot.owner else model
    (owner._parameters if slot.is_param else owner._buffers)[slot.attr] = value
