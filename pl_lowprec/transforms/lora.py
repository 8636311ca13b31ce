"""peft LoRA adapters injected into any module, plain or quantized, with a selective k-bit preparation.

``inject_lora`` uses peft's own ``inject_adapter_in_model``, so a ``Linear4bit`` or ``Linear8bitLt`` base gets
peft's bitsandbytes-aware LoRA layer (which can merge), and a plain ``nn.Linear`` gets the plain one.
``target_modules="all-linear"`` (the default) works for any module, not only ``PreTrainedModel``: it expands to
every linear layer except the ones that quantization leaves alone by default (the output heads).

``prepare_for_kbit_training`` is the selective alternative to peft's ``prepare_model_for_kbit_training``: it
upcasts only what mixed precision needs in fp32 (trainable adapters, norm weights) and leaves embeddings and
the output head in their dtype, where peft upcasts every non-quantized parameter (bitsandbytes #1569).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from pl_lowprec._checks import check_at_least, check_fraction, check_positive
from pl_lowprec._imports import import_peft
from pl_lowprec.transforms.dtypes import HALF_DTYPES, upcast_to_fp32
from pl_lowprec.transforms.linear_filter import DEFAULT_SKIP, is_target_linear, linear_names, matches_any
from pl_lowprec.transforms.nf4 import is_nf4

ADAPTER_NAME = "default"
# The heads a task's model adds, trained whole beside the adapters: what peft's task models
# (PeftModelForSequenceClassification, ...ForTokenClassification, ...ForQuestionAnswering) add to modules_to_save.
TASK_HEADS = {"SEQ_CLS": ("classifier", "score"), "TOKEN_CLS": ("classifier", "score"), "QUESTION_ANS": ("qa_outputs",)}


def lora_config(lora: Any) -> Any:
    """A ``peft.LoraConfig`` from a config or a dict of its fields (YAML); ``target_modules`` defaults to all-linear."""
    peft = import_peft()
    if isinstance(lora, peft.LoraConfig):
        return lora
    if not isinstance(lora, Mapping):
        raise TypeError(f"lora= takes a peft.LoraConfig or a dict of its fields, got {type(lora).__name__}.")
    fields = {"target_modules": "all-linear", **lora}
    try:
        config = peft.LoraConfig(**fields)
    except (TypeError, ValueError) as err:
        hint = ""
        if "target_modules" not in lora and "target_modules" in str(err):
            hint = (
                " target_modules was left at this package's default, 'all-linear' (a string): name the layers as a"
                " list to combine them with that option, e.g. [q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj,"
                " down_proj]."
            )
        raise ValueError(f"lora={dict(lora)!r} is not a valid peft.LoraConfig: {str(err).rstrip('.')}.{hint}") from err
    check_lora_numbers(config)
    return with_task_heads(config)


def with_task_heads(config: Any) -> Any:
    """``config`` whose ``task_type`` names a task with a new head (``SEQ_CLS``, ``TOKEN_CLS``, ``QUESTION_ANS``)
    with that head in ``modules_to_save``, as peft's ``get_peft_model`` does: ``inject_adapter_in_model`` ignores
    ``task_type``, which left a classifier's freshly initialized head frozen."""
    heads = TASK_HEADS.get(str(getattr(config.task_type, "value", config.task_type)), ())
    saved = list(config.modules_to_save or ())
    missing = [head for head in heads if head not in saved]
    if not missing:
        return config
    return config.__class__(**{**config.to_dict(), "modules_to_save": saved + missing})


def trained_copies(model: nn.Module) -> dict[str, nn.Module]:
    """The modules trained whole beside the adapters (``modules_to_save``: peft's ``ModulesToSaveWrapper``)."""
    peft = import_peft()
    return {n: m for n, m in model.named_modules() if isinstance(m, peft.utils.other.ModulesToSaveWrapper)}


def left_tied_to_originals(model: nn.Module) -> dict[str, str]:
    """``{module name: trained copy's name}`` for each module whose weight is tied to one that ``modules_to_save``
    trains a copy of (a tied ``lm_head`` under a trained ``embed_tokens``): it keeps the original rows, as peft
    leaves it, so the two are no longer tied."""
    originals = {
        id(wrapper.original_module.weight): name
        for name, wrapper in trained_copies(model).items()
        if isinstance(getattr(wrapper.original_module, "weight", None), nn.Parameter)
    }
    return {
        name: originals[id(module.weight)]
        for name, module in model.named_modules()
        if isinstance(getattr(module, "weight", None), nn.Parameter)
        and id(module.weight) in originals
        and not is_within(name, originals[id(module.weight)])
    }


def is_within(name: str, module_name: str) -> bool:
    """Whether module ``name`` is ``module_name`` or inside it."""
    return name == module_name or name.startswith(f"{module_name}.")


def check_lora_numbers(config: Any) -> None:
    """Rank, alpha and dropout checked when the strategy is built; peft checks ``r`` only while injecting."""
    check_at_least("LoraConfig", 1, "The adapter rank: 8 or 16 is usual; higher learns more.", r=config.r)
    check_positive("LoraConfig", "The update is scaled by lora_alpha / r; usually 2 x r.", lora_alpha=config.lora_alpha)
    check_fraction("LoraConfig", high_open=True, hint="0.0 turns dropout off.", lora_dropout=config.lora_dropout)


def has_lora(model: nn.Module) -> bool:
    peft = import_peft()
    return any(isinstance(m, peft.tuners.lora.LoraLayer) for m in model.modules())


def resolve_targets(model: nn.Module, config: Any, skip: tuple[str, ...] = DEFAULT_SKIP) -> list[str]:
    """Full names of the linear layers the config targets; ``ValueError`` listing the linear names if none."""
    linears = linear_names(model)
    target = config.target_modules
    if target in ("all-linear", "all_linear"):
        chosen = [n for n, m in model.named_modules() if n and is_target_linear(m, n, skip, exact=False)]
    else:
        chosen = [n for n in linears if named_by(target, n)]
    refuse_non_linear_targets(model, target)
    if not chosen:
        shown = sorted(target) if isinstance(target, (set, frozenset)) else target  # peft stores a set
        raise ValueError(
            f"LoRA target_modules={shown!r} matches no linear layer of {type(model).__name__}."
            f" Its linear layers are: {', '.join(linears) or 'none'}. Name them by their last part"
            " (e.g. ['q_proj', 'v_proj']), by a regular expression over full names, or use 'all-linear'."
        )
    return chosen


def named_by(target: Any, name: str) -> bool:
    """Whether peft's ``target_modules`` (or ``modules_to_save``) names module ``name``: a string is a regular
    expression over full names, a list names modules in full or by their last part."""
    if isinstance(target, str):
        return re.fullmatch(target, name) is not None
    names = set(target or ())
    return name in names or name.rpartition(".")[2] in names


# Modules besides linear layers that peft's get_peft_model gives LoRA layers of their own (lora.Embedding, Conv*d)
NON_LINEAR_TARGETS = (nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def refuse_non_linear_targets(model: nn.Module, target: Any) -> None:
    """Refuse ``target_modules`` that name an embedding or convolution: peft's ``get_peft_model`` adapts them, the
    strategy adds LoRA to linear layers only, and dropped them in silence (fewer adapters than peft's)."""
    if target in ("all-linear", "all_linear"):
        return
    named = [n for n, m in model.named_modules() if isinstance(m, NON_LINEAR_TARGETS) and named_by(target, n)]
    if named:
        kinds = ", ".join(f"{n} ({type(model.get_submodule(n)).__name__})" for n in named[:4])
        raise ValueError(
            f"LoRA target_modules names {kinds}{', ...' if len(named) > 4 else ''}: peft's get_peft_model would"
            " add LoRA there too, and the strategy adds LoRA to linear layers only, so it would be left out."
            " Fix: drop it from target_modules, or train it whole with modules_to_save (e.g. modules_to_save:"
            " [embed_tokens])."
        )


def all_linear_against_peft(model: nn.Module, config: Any, skip: tuple[str, ...], adapted: list[str]) -> str:
    """What ``target_modules="all-linear"`` adapts here unlike peft's, which takes every linear layer but the output
    layer: under a quantization ``skip_modules`` of the user's, LoRA leaves its layers alone (peft adapts them) and
    adapts an output head that list quantizes (peft never does). ``""`` where they agree. Said in the LoRA line:
    the count alone did not show it."""
    if config.target_modules not in ("all-linear", "all_linear") or tuple(skip) == DEFAULT_SKIP:
        return ""
    linears = [n for n in linear_names(model) if "lora_" not in n]
    kept_out = [n for n in linears if matches_any(n, skip) and not matches_any(n, DEFAULT_SKIP)]
    heads = [n for n in adapted if matches_any(n, DEFAULT_SKIP)]
    parts = []
    if kept_out:
        parts.append(f"leaves out the {len(kept_out)} layers skip_modules keeps unquantized ({_shown(kept_out)})")
    if heads:
        parts.append(f"adapts the output heads {_shown(heads)}, which it does not name")
    if not parts:
        return ""
    return (
        f" all-linear under quantization skip_modules={list(skip)} {' and '.join(parts)}; peft's all-linear adapts"
        " every linear layer but the output layer: name the layers in target_modules to choose."
    )


def _shown(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f", ... ({len(names)})" if len(names) > 3 else "")


def refuse_packed_modules_to_save(model: nn.Module, modules_to_save: Any) -> None:
    """Refuse ``modules_to_save`` naming a module whose weights quantization packed into integers: peft's trained copy
    of it stopped in a traceback inside peft or bitsandbytes ("only Tensors of floating point dtype can require
    gradients"), or, for torchao's NF4 (``lowprec_fsdp``), whose tensors say they are floating point, inside
    torchao's re-quantizing copy ("Number of scalers must be divisible by scaler block size")."""
    named = [n for n, _ in model.named_modules() if n and named_by(list(modules_to_save or ()), n)]
    packed = [n for n in named if any(_is_packed(p) for p in model.get_submodule(n).parameters())]
    if packed:
        shown = ", ".join(packed[:4]) + (", ..." if len(packed) > 4 else "")
        raise ValueError(
            f"LoRA modules_to_save names {shown}, whose weights quantization has packed into 4/8-bit integers: a"
            " module trained whole needs floating-point weights. Fix: add it to quantization's skip_modules (it"
            " stays 16-bit and trains whole), or adapt it with LoRA instead (target_modules)."
        )


def _is_packed(param: torch.Tensor) -> bool:
    """Integer storage (bitsandbytes) or an NF4 tensor (torchao, sharded or not): not a weight to train whole."""
    return not param.is_floating_point() or is_nf4(param)


def peft_selected(config: Any, names: list[str]) -> list[str]:
    """``names`` as peft selects them from ``exclude_modules``, ``modules_to_save`` (never adapted) and
    ``layers_to_transform``/``layers_pattern``. Applied here because the injection names its targets exactly, by a
    regular expression, which peft does not combine with layer indexes, and so the count said is the count adapted."""
    if not (config.exclude_modules or config.modules_to_save or config.layers_to_transform not in (None, [])):
        return names
    peft = import_peft()
    probe = config.__class__(**{**config.to_dict(), "target_modules": sorted({n.rpartition(".")[2] for n in names})})
    kept = [n for n in names if peft.tuners.tuners_utils.check_target_module_exists(probe, n)]
    if not kept:
        raise ValueError(
            f"LoRA exclude_modules={config.exclude_modules!r}, layers_to_transform={config.layers_to_transform!r}"
            f" (layers_pattern={config.layers_pattern!r}) keep none of the {len(names)} target layers (e.g."
            f" {names[0]}): give indexes of the model's blocks, and layers_pattern as the name of their list (e.g."
            " 'layers')."
        )
    return kept


def inject_lora(model: nn.Module, lora: Any, skip: tuple[str, ...] = DEFAULT_SKIP) -> list[str]:
    """Inject LoRA adapters (idempotent) and freeze everything else; return the adapted layer names."""
    peft = import_peft()
    config = lora_config(lora)
    if has_lora(model):
        return sorted(n for n, m in model.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer))
    refuse_packed_modules_to_save(model, config.modules_to_save)
    targets = peft_selected(config, resolve_targets(model, config, skip))
    layers = {"layers_to_transform": None, "layers_pattern": None}  # applied: peft takes them with name lists only
    exact = config.__class__(**{**config.to_dict(), **layers, "target_modules": _exact_regex(targets)})
    # peft picks its bitsandbytes-aware LoRA layers only when the root model says it was loaded in 4/8 bit,
    # as transformers' models do; say so for the duration of the injection.
    kinds = {type(model.get_submodule(n)).__name__ for n in targets}
    flags = {"is_loaded_in_4bit": "Linear4bit" in kinds, "is_loaded_in_8bit": "Linear8bitLt" in kinds}
    previous = {k: model.__dict__.get(k) for k in flags}
    try:
        model.__dict__.update(flags)
        peft.inject_adapter_in_model(exact, model, adapter_name=ADAPTER_NAME)
    finally:
        for key, value in previous.items():
            if value is None:
                model.__dict__.pop(key, None)
            else:
                model.__dict__[key] = value
    return targets


def _exact_regex(names: list[str]) -> str:
    return "(?:" + "|".join(re.escape(n) for n in names) + ")"


def is_norm(module: nn.Module) -> bool:
    """LayerNorm, GroupNorm, and RMSNorm classes of any library (``LlamaRMSNorm`` included)."""
    return isinstance(module, (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm)) or type(module).__name__.endswith("RMSNorm")


def prepare_for_kbit_training(model: nn.Module, mixed_precision: bool) -> int:
    """Under mixed precision, upcast trainable parameters and norm weights to fp32; return the bytes added.

    Frozen embeddings, the output head and other frozen weights keep their dtype: they are read in the
    compute dtype anyway, and upcasting them is what makes peft's preparation cost more than bf16 LoRA.
    """
    if not mixed_precision:
        return 0
    upcast: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            wanted = param.requires_grad or is_norm(module)
            if wanted and param.dtype in HALF_DTYPES:
                upcast[id(param)] = param
    added = 0
    for param in upcast.values():
        added += param.numel() * 2
        upcast_to_fp32(param)  # a rank's rows too (under FSDP2 they stayed bf16: mixed gradient dtypes)
    return added


BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")  # peft moves part of the base into A, B


def lora_init_among(model_or_config: Any, names: tuple[str, ...]) -> str | None:
    """The adapters' ``init_lora_weights`` (of a model's LoRA, a ``LoraConfig``, or ``None``) where it is one of
    ``names`` (``"pissa"`` also names ``"pissa_niter_4"``), else ``None``."""
    config = getattr(model_or_config, "peft_config", {}).get(ADAPTER_NAME, model_or_config)
    init = getattr(config, "init_lora_weights", None)
    return init if isinstance(init, str) and init.lower().startswith(names) else None


def base_changing_init(model_or_config: Any) -> str | None:
    """The adapters' ``init_lora_weights`` where it rewrites the base weight as LoRA is added (PiSSA's principal
    components move into A and B, the base keeps the residual), else ``None``: their A and B then mean nothing on
    the original base."""
    return lora_init_among(model_or_config, BASE_CHANGING_INITS)


def plain_key(name: str) -> str:
    """A parameter's key in the model without peft's wrappers (``q_proj.base_layer.weight`` is ``q_proj.weight``)."""
    return name.replace(f".modules_to_save.{ADAPTER_NAME}.", ".").replace(".base_layer.", ".")


def lora_layers(model: nn.Module) -> dict[str, nn.Module]:
    peft = import_peft()
    return {n: m for n, m in model.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)}
