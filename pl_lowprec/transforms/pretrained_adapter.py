"""``pretrained_adapter=``: LoRA training that continues a saved peft adapter directory.

What peft's ``PeftModel.from_pretrained(base, directory, is_trainable=True)`` and axolotl's ``lora_model_dir`` do:
the adapter's own ``LoraConfig`` (``adapter_config.json``: rank, alpha, targets, rsLoRA, DoRA, modules_to_save)
is the LoRA the strategy adds, with ``inference_mode`` off, and its tensors (``adapter_model.safetensors``) replace
the fresh adapters once they are injected, through peft's own ``set_peft_model_state_dict`` (its key mapping:
adapter name, modules_to_save, DoRA magnitudes). ``lora=`` beside it may only repeat the saved values (or set
``lora_dropout``, which changes training, not what the adapter computes); any other difference is refused: the
saved tensors have the saved shapes and scale. The directory is resolved as ``pretrained=`` is (a local
directory, else a hub id downloaded where there is network). The memory estimator takes the config's shapes and
loads nothing.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from contextlib import AbstractContextManager
from dataclasses import fields
from pathlib import Path
from typing import Any

from torch import nn

from pl_lowprec._imports import import_peft
from pl_lowprec._per_command import PerCommand
from pl_lowprec.adapters import find_base_model, mismatch_summary, recorded_base
from pl_lowprec.loading.hub import hub_snapshot, is_hub_id
from pl_lowprec.transforms.lora import ADAPTER_NAME, base_changing_init, lora_config, with_task_heads

ADAPTER_FILES = ["adapter_config.json", "adapter_model.safetensors", "adapter_model.bin"]
TRAINING_ONLY = ("lora_dropout",)  # may differ from the saved config: it changes training, not the adapter's output
NOT_COMPARED = ("inference_mode",)  # turned off here; inference_mode=True in lora= is refused by check_lora_options
PEFT_PREFIX = "base_model.model."  # the saved names are those under PeftModel, which wraps the base as base_model.model
DATA_DRIVEN_INITS = ("eva", "lora_ga")  # only start A and B, which the saved tensors replace
# what the saved tensors' shapes and scale follow: compared at any value when lora= is a LoraConfig object
ADAPTER_DEFINING = ("r", "lora_alpha", "use_rslora", "use_dora", "target_modules", "rank_pattern", "alpha_pattern")


_RESOLVED: PerCommand[dict[str, Path]] = PerCommand("resolved_adapters", dict)


def adapters_resolved_once() -> AbstractContextManager[dict[str, Path]]:
    """Within (each ``pl-lowprec`` command): a ``pretrained_adapter`` is resolved once and its directory reused.
    ``plan`` and ``fit``'s ``"auto"`` rebuild the strategy's config for every candidate (``dataclasses.replace``),
    and each rebuild resolved the adapter again: a hub round trip per candidate. Nested, the outer one's stand."""
    return _RESOLVED.scope()


def resolve_adapter(source: str | Path) -> Path:
    """A local adapter directory as it is; a hub id downloaded (adapter files only) where there is network; the
    directory found before for the same source inside ``adapters_resolved_once``."""
    return _RESOLVED.cached(str(source), lambda: _resolved(source))


def _resolved(source: str | Path) -> Path:
    path = Path(source).expanduser()
    shown = f"pretrained_adapter={str(source)!r}"
    if path.is_dir():
        if not (path / "adapter_config.json").is_file():
            is_model = (path / "config.json").is_file()
            model = " It holds config.json: a model directory, which pretrained= takes." if is_model else ""
            raise ValueError(
                f"{shown} has no adapter_config.json: it is not a peft adapter directory (what"
                f" PeftModel.save_pretrained or `pl-lowprec export` without --merged writes).{model}"
            )
        return path
    if not is_hub_id(source):
        what = "is a file" if path.exists() else f"does not exist (relative to {Path.cwd()})"
        raise ValueError(
            f"{shown} is neither an adapter directory nor a hub id such as 'org/name': the path {what}. Name a peft"
            " adapter directory (adapter_config.json and adapter_model.safetensors) or a hub id."
        )
    return hub_snapshot(str(source), ADAPTER_FILES, "pretrained_adapter=")


def adapter_lora_config(directory: Path, lora: Any, source: str | Path) -> Any:
    """The saved ``LoraConfig`` for training (``inference_mode`` off), with what ``lora=`` sets beside it where that
    agrees (``lora_dropout`` may differ); a difference is refused in one paragraph."""
    peft = import_peft()
    shown = f"pretrained_adapter={str(source)!r}"
    saved = peft.PeftConfig.from_pretrained(str(directory))
    if not isinstance(saved, peft.LoraConfig):
        raise ValueError(
            f"{shown} is a {saved.peft_type} adapter (adapter_config.json's peft_type): the strategies train LoRA"
            " only. Name a LoRA adapter directory, or leave out pretrained_adapter to start a new LoRA."
        )
    saved.inference_mode = False
    init = base_changing_init(saved)
    if init is not None:
        raise ValueError(
            f"{shown} was saved with init_lora_weights={init!r} and not converted: its A and B belong to the residual"
            " base that initialization left (part of each weight moved into A and B), not to the original weights."
            " Fix: save it converted for the original base (peft's save_pretrained("
            "path_initial_model_for_weight_conversion=...), which `pl-lowprec export` does), or train on the"
            " residual base it was saved with (pretrained= that model)."
        )
    if isinstance(saved.init_lora_weights, str) and saved.init_lora_weights.lower() in DATA_DRIVEN_INITS:
        saved.init_lora_weights = True  # the saved tensors replace the init: no pass over data is needed
    return _with_agreeing(with_task_heads(saved), _given_fields(lora), shown)


def _given_fields(lora: Any) -> dict[str, Any]:
    """What ``lora=`` sets: a dict's keys; of a ``LoraConfig``, the fields that differ from peft's defaults and, at
    any value, those that make the adapter what it is (``ADAPTER_DEFINING``): an object cannot say which fields were
    left at their defaults, and ``LoraConfig(r=8)`` beside a rank-4 adapter must not train rank 4 in silence."""
    if lora is None:
        return {}
    if isinstance(lora, Mapping):
        return dict(lora)
    lora = lora_config(lora)  # a LoraConfig as it is; anything else refused, naming what lora= takes
    default = import_peft().LoraConfig()
    return {
        f.name: getattr(lora, f.name)
        for f in fields(lora)
        if f.init and (f.name in ADAPTER_DEFINING or getattr(lora, f.name) != getattr(default, f.name))
    }


def _with_agreeing(saved: Any, given: dict[str, Any], shown: str) -> Any:
    if not given:
        return saved
    try:
        merged = saved.__class__(**{**saved.to_dict(), **given})
    except (TypeError, ValueError) as err:
        raise ValueError(f"lora={given!r} beside {shown} is not a valid peft.LoraConfig: {err}") from err
    differ = [
        f"{key}={_shown(getattr(merged, key))} (saved: {_shown(getattr(saved, key, None))})"
        for key in given
        if key not in TRAINING_ONLY + NOT_COMPARED and getattr(merged, key, None) != getattr(saved, key, None)
    ]
    if differ:
        raise ValueError(
            f"{shown} brings its own LoraConfig (adapter_config.json), and lora= sets other values:"
            f" {', '.join(differ)}."
            " The saved tensors have the saved ranks, targets and scale, so training under other options would not"
            " continue that adapter. Fix: drop these from lora= (the saved values are used; lora= may set"
            " lora_dropout; a LoraConfig object sets every field, so give lora= as a dict of the fields to set), or"
            " leave out pretrained_adapter to train a new adapter with them."
        )
    return merged


def _shown(value: Any) -> str:
    return repr(sorted(value)) if isinstance(value, (set, frozenset)) else repr(value)


def rooted_targets(config: Any, base_name: str) -> Any:
    """``config`` with its regular expressions over module names (``target_modules``, ``exclude_modules`` given as
    one string) rooted at ``base_name``: peft matches them against the names under the model it wraps, the strategy
    against the names under the ``LightningModule`` holding it (``model.`` in front)."""
    changed = {
        key: f"{re.escape(base_name)}\\.(?:{value})"
        for key in ("target_modules", "exclude_modules")
        if isinstance(value := getattr(config, key), str) and value not in ("all-linear", "all_linear")
    }
    if not base_name or not changed:
        return config
    return config.__class__(**{**config.to_dict(), **changed})


def load_adapter_weights(model: nn.Module, directory: Path, source: str | Path, base_name: str) -> int:
    """Load the adapter's tensors into the injected LoRA (and modules_to_save) under the Hugging Face model inside
    ``model``; return how many. Refused, naming the adapter, the base and a tensor, where they do not fit."""
    peft = import_peft()
    _, base = find_base_model(model)
    saved = peft.utils.load_peft_weights(str(directory), device="cpu")
    tensors = {key.removeprefix(PEFT_PREFIX): tensor for key, tensor in saved.items()}  # names under the base
    shown = f"pretrained_adapter={str(source)!r}"
    fix = (
        f" The adapter was saved for another base model (adapter_config.json names"
        f" {recorded_base(directory)!r}) than this run's ({base_name}). Fix: pretrained= the base it was trained on,"
        " or leave out pretrained_adapter to train a new adapter."
    )
    own_config = "peft_config" not in base.__dict__
    if own_config:  # set_peft_model_state_dict reads the config from the module it loads into
        base.__dict__["peft_config"] = model.peft_config
    try:
        result = peft.set_peft_model_state_dict(base, tensors, adapter_name=ADAPTER_NAME)
    except (RuntimeError, KeyError) as err:
        summary = mismatch_summary(err) if isinstance(err, RuntimeError) else f"no tensor {err} in it"
        raise ValueError(f"{shown} does not fit the model: {summary}.{fix}") from err
    finally:
        if own_config:
            base.__dict__.pop("peft_config", None)
    trainable = {name for name, p in base.named_parameters() if p.requires_grad}
    missing = [key for key in result.missing_keys if key in trainable]
    parts = [(result.unexpected_keys, "tensors with no place in the model"), (missing, "adapters it lacks")]
    found = [f"{len(keys)} {what} (e.g. {', '.join(keys[:2])})" for keys, what in parts if keys]
    if found:
        raise ValueError(f"{shown} does not fit the model: {'; '.join(found)}.{fix}")
    return len(tensors)
