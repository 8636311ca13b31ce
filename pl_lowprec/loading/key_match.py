"""Which checkpoint key fills which module tensor, checked from the file headers before anything is read.

A module that holds a Hugging Face model as ``self.model`` has every key of the checkpoint one prefix deeper
(``model.model.layers.0...`` against ``model.layers.0...``). Where ``pretrained_prefix`` is not given and exactly
one prefix makes every key and every shape match, it is taken and said in one line, as ``from_pretrained`` takes
a model's ``base_model_prefix``; anything short of a full match is refused, naming every missing, unexpected and
mis-shaped key and the prefix to try. The one exception is a task's new head that LoRA trains whole
(``modules_to_save``, e.g. a classifier's ``score``): it may be missing, starting from its own initialization, and
the checkpoint's own head (``lm_head``) then goes unread.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn

from pl_lowprec.loading.sources import CheckpointIndex, WeightFiles, resolve_checkpoint
from pl_lowprec.transforms.conv1d import stored_transposed
from pl_lowprec.transforms.linear_filter import DEFAULT_SKIP, matches_any

Prefix = str | Mapping[str, str] | None


@dataclass(frozen=True)
class Slot:
    """One place a tensor lives in the module: ``owner._parameters[attr]`` or ``owner._buffers[attr]``."""

    owner: str
    attr: str
    is_param: bool


class CheckpointMismatch(ValueError):
    """The checkpoint's keys or shapes are not the module's; ``suggested_prefix`` would map the one onto the
    other where the keys differ by a prefix."""

    def __init__(self, message: str, suggested_prefix: Prefix) -> None:
        super().__init__(message)
        self.suggested_prefix = suggested_prefix


def slots(model: nn.Module) -> tuple[dict[str, Slot], list[list[str]]]:
    """Every state-dict key (parameters, persistent buffers) and the groups of keys that share one tensor."""
    found: dict[str, Slot] = {}
    groups: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        tensors = [(a, t, True) for a, t in module._parameters.items()]
        tensors += [(a, t, False) for a, t in module._buffers.items() if a not in module._non_persistent_buffers_set]
        for attr, tensor, is_param in tensors:
            if tensor is None:
                continue
            key = f"{name}.{attr}" if name else attr
            found[key] = Slot(name, attr, is_param)
            groups.setdefault(id(tensor), []).append(key)
    return found, list(groups.values())


@dataclass(frozen=True)
class KeyMatch:
    """Where each tensor of the module comes from."""

    chosen: dict[str, str]  # the first key of each tensor group: the checkpoint key it is read from
    fresh: list[str] = field(default_factory=list)  # keys of a new head (modules_to_save) in no checkpoint
    unused: list[str] = field(default_factory=list)  # the checkpoint's keys of a head the module does not have
    computed: list[str] = field(default_factory=list)  # the checkpoint's copies of buffers the module computes


def is_under(name: str, modules: tuple[str, ...]) -> bool:
    """Whether module ``name`` is one of ``modules`` (named in full or by its last parts, as peft matches)."""
    return any(name == m or name.endswith("." + m) for m in modules)


def check_against(
    model: nn.Module, index: CheckpointIndex, prefix: Prefix = None, inferred: bool = False, new_heads: tuple = ()
) -> KeyMatch:
    """For each tensor group, the key to read it from; ``CheckpointMismatch`` naming every missing, unexpected and
    mis-shaped key. With ``new_heads`` (LoRA's ``modules_to_save``, a task's head), their keys may be missing
    (they start from their own initialization) and the checkpoint's own head keys may go unused: a causal LM's
    checkpoint loads into a classifier, as ``from_pretrained`` loads it."""
    module_slots, groups = slots(model)
    state = dict(model.state_dict(keep_vars=True))
    chosen: dict[str, str] = {}
    missing: list[str] = []
    fresh: list[str] = []
    for keys in groups:
        present = [k for k in keys if k in index.tensors]
        if present:
            chosen[keys[0]] = present[0]
        elif new_heads and is_under(module_slots[keys[0]].owner, new_heads):
            fresh.append(keys[0])
        else:
            missing.append(keys[0])
    unexpected = [k for k in index.tensors if k not in module_slots]
    unused = [k for k in unexpected if new_heads and _is_head_key(k)]
    computed = computed_buffer_copies([k for k in unexpected if k not in unused], model)
    unexpected = [k for k in unexpected if k not in unused and k not in computed]
    shapes = {k: _checkpoint_shape(model, module_slots[k], state[k]) for k in chosen.values()}
    mis_shaped = [
        f"{k}: checkpoint {list(index.tensors[k].shape)}, module {list(shapes[k])}"
        for k in chosen.values()
        if shapes[k] != index.tensors[k].shape
    ]
    if missing or unexpected or mis_shaped:
        file_keys = [info.key for info in index.tensors.values()]  # as the files name them, before any prefix
        hint = suggest_prefix(list(module_slots), file_keys) if missing and unexpected else None
        message = _mismatch_message(model, index, prefix, inferred, missing, unexpected, mis_shaped, hint)
        raise CheckpointMismatch(message, hint)
    return KeyMatch(chosen, fresh, unused, computed)


def computed_buffer_copies(keys: list[str], model: nn.Module) -> list[str]:
    """The keys that name, by their last two parts, a buffer the module computes and never loads (non-persistent):
    checkpoints of older transformers saved ``rotary_emb.inv_freq`` in every layer and ``position_ids``, which
    ``from_pretrained`` leaves unread (``_adjust_missing_and_unexpected_keys``); so are they here."""
    computed = set()
    for name, module in model.named_modules():
        for attr in module._non_persistent_buffers_set:
            computed.add(".".join([*name.split(".")[-1:], attr]) if name else attr)
    return [k for k in keys if ".".join(k.split(".")[-2:]) in computed or k.rpartition(".")[2] in computed]


def _checkpoint_shape(model: nn.Module, slot: Slot, tensor: torch.Tensor) -> tuple[int, ...]:
    """The shape a checkpoint holds the tensor in: transposed for a weight of a converted Conv1D."""
    owner = model.get_submodule(slot.owner) if slot.owner else model
    return tuple(tensor.shape)[::-1] if stored_transposed(owner, slot.attr) else tuple(tensor.shape)


def fitting_index(
    model: nn.Module,
    source: str | Path,
    prefix: Prefix,
    new_heads: tuple = (),
    expected_prefix: str | None = None,
    *,
    files: WeightFiles,
) -> tuple[CheckpointIndex, KeyMatch, Prefix]:
    """The checkpoint's index under ``prefix``, where each tensor comes from, and the prefix used: the one given,
    or, where none was given, ``expected_prefix`` (what the module's keys usually need, taken without a word) and
    else the one prefix under which every key and shape matches (a base model's checkpoint, a peft wrapper's)."""
    first = prefix if prefix is not None else expected_prefix
    index = resolve_checkpoint(source, first, files=files)
    try:
        return index, check_against(model, index, first, new_heads=new_heads), first
    except CheckpointMismatch as mismatch:
        guess = mismatch.suggested_prefix
        if prefix is not None or guess is None or guess == (first or ""):
            raise
    index = resolve_checkpoint(source, guess, files=files)
    match = check_against(model, index, guess, inferred=True, new_heads=new_heads)
    heads = " but for the heads named next" if match.fresh or match.unused else ""
    usual = f", not the usual {expected_prefix!r}" if expected_prefix is not None else ""
    choose = "" if expected_prefix is not None else " (name pretrained_prefix to choose another)"
    rank_zero_info(
        f"pretrained={str(index.source)!r}: took pretrained_prefix={guess!r}{usual}, under which every key and"
        f" shape of the checkpoint matches {type(model).__name__}'s{heads}{choose}."
    )
    return index, match, guess


def _shown(keys: list[str], limit: int = 8) -> str:
    return ", ".join(keys[:limit]) + (f", ... ({len(keys)} in all)" if len(keys) > limit else "")


def _mismatch_message(model, index, prefix, inferred, missing, unexpected, mis_shaped, hint) -> str:
    parts = [f"pretrained={str(index.source)!r} does not fit {type(model).__name__}"]
    if prefix:
        origin = ", the prefix its keys suggest" if inferred else ""
        parts[0] += f" (with pretrained_prefix={prefix!r}{origin})"
    parts[0] += "; nothing was loaded."
    if missing:
        parts.append(f"Missing from the checkpoint: {_shown(missing)}.")
    if unexpected:
        parts.append(f"In the checkpoint but not in the module: {_shown(unexpected)}.")
    if mis_shaped:
        parts.append(f"Shapes differ: {_shown(mis_shaped, 4)}.")
    if missing and all(map(_is_head_key, missing)) and all(map(_is_head_key, unexpected)):
        heads = sorted({k.rpartition(".")[0] for k in missing})
        last = sorted({h.rpartition(".")[2] for h in heads})
        parts.append(
            f"Only the heads differ: {', '.join(heads)} is a new head, which trains from its own initialization"
            f" when LoRA names it: lora task_type 'SEQ_CLS' (a classifier's score or classifier), or"
            f" modules_to_save={last}."
        )
        if not unexpected and "lm_head" in last:
            parts.append(
                "A checkpoint with no lm_head at all is a base model's (AutoModel.save_pretrained): a causal LM needs"
                " its trained output head, so load the ForCausalLM checkpoint of the same model."
            )
    elif hint == prefix:
        pass  # read with that prefix already
    elif hint == "" and prefix:
        parts.append("The module's keys are the checkpoint's as they are: leave out pretrained_prefix.")
    elif hint:
        parts.append(f"The module's keys are the checkpoint's with another prefix: try pretrained_prefix={hint!r}.")
    elif mis_shaped:
        parts.append("Build the module with the checkpoint's config (sizes, vocabulary).")
    elif unexpected and not missing:
        parts.append(
            "The module has no such tensors: build it from the checkpoint's own config.json; to drop tensors the"
            " model does not use, load the checkpoint once with from_pretrained and save_pretrained it again."
        )
    return " ".join(parts)


def _is_head_key(key: str) -> bool:
    """A key of an output head (``lm_head``, ``score``, ``classifier``, ``head``), which tasks do not share."""
    return matches_any(key.rpartition(".")[0], DEFAULT_SKIP)


def suggest_prefix(module_keys: list[str], file_keys: list[str]) -> str | dict[str, str] | None:
    """The prefix that makes most of the files' keys module keys, if there is one; ``""`` where most are already."""
    module_set = set(module_keys)
    if sum(k in module_set for k in file_keys) > len(file_keys) // 2:
        return ""
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
