"""The adapters as PiSSA and OLoRA initialised them, kept so that an adapter directory loads onto the original base.

These initializations move part of each weight into A and B and leave the residual in the base
(``W = W_res + scale * B0 @ A0``), so the trained A and B mean nothing on the original weights. peft converts such
an adapter into a plain LoRA of twice the rank that does: ``scale * (B @ A - B0 @ A0) = scale * [B | -B0] @ [A; A0]``
(``PeftModel.save_pretrained(path_initial_model_for_weight_conversion=...)``, ``LoraModel.subtract_mutated_init``),
from the adapters saved before training. Here A0 and B0 are kept in CPU memory when LoRA is injected (the same on
every rank), and ``export_adapter`` writes that conversion with peft's config changes: ``r`` and every
``rank_pattern`` entry doubled, ``lora_alpha`` doubled (times sqrt 2 under rsLoRA) so the scale stays, and
``init_lora_weights=True``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pl_lowprec.distributed.mesh import full_tensor
from pl_lowprec.transforms.lora import ADAPTER_NAME, base_changing_init, lora_init_among, lora_layers

CONVERTIBLE_INITS = ("pissa", "olora")  # of lora.BASE_CHANGING_INITS, those the strategy runs (the others are refused)
INITIAL = "_pl_lowprec_initial_lora"  # a plain attribute: in no state dict, never moved to a device


def convertible_init(model_or_config: Any) -> str | None:
    """``init_lora_weights`` where it rewrote the base and the adapter export converts it (PiSSA, OLoRA)."""
    return lora_init_among(model_or_config, CONVERTIBLE_INITS)


def keep_initial_adapters(model: nn.Module) -> None:
    """Keep each LoRA layer's A0 and B0 in CPU memory where PiSSA or OLoRA initialised them."""
    if convertible_init(model) is None:
        return
    for layer in lora_layers(model).values():
        if ADAPTER_NAME not in getattr(layer, "lora_A", {}) or INITIAL in layer.__dict__:
            continue
        a, b = (full_tensor(m[ADAPTER_NAME].weight.detach()) for m in (layer.lora_A, layer.lora_B))
        if not (a.is_meta or b.is_meta):  # meta: nothing initialised yet
            layer.__dict__[INITIAL] = (a.cpu().clone(), b.cpu().clone())


def initial_adapters(layer: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    return layer.__dict__.get(INITIAL)


def converted_config(config: Any) -> Any:
    """A copy of the ``LoraConfig`` for the converted adapter: twice the rank at the same scale, a plain init."""
    if config.use_rslora and (config.rank_pattern or config.alpha_pattern):
        raise ValueError(
            f"lora init_lora_weights={config.init_lora_weights!r} with use_rslora=True and rank_pattern or"
            " alpha_pattern: converting its adapters to a LoRA for the original base is not defined for that"
            " combination (peft refuses it too). Export the merged model (--merged), or train without the patterns."
        )
    fields = config.to_dict()
    fields["init_lora_weights"] = True
    fields["r"] = 2 * config.r
    fields["lora_alpha"] = config.lora_alpha * (2**0.5 if config.use_rslora else 2)
    fields["rank_pattern"] = {k: 2 * v for k, v in (config.rank_pattern or {}).items()}
    fields["alpha_pattern"] = {k: 2 * v for k, v in (config.alpha_pattern or {}).items()}
    return config.__class__(**fields)


def check_convertible(config: Any, layers: dict[str, nn.Module]) -> None:
    """Refuse what the conversion cannot express: DoRA's magnitudes, B's bias, layers without their A0 and B0."""
    init = config.init_lora_weights
    if config.use_dora or config.lora_bias:
        option = "use_dora=True" if config.use_dora else "lora_bias=True"
        raise ValueError(
            f"lora init_lora_weights={init!r} with {option}: the adapter directory for the original base is a LoRA"
            f" of twice the rank (B @ A - B0 @ A0), which cannot carry {option}. Export the merged model (--merged)."
        )
    missing = sorted(name for name, layer in layers.items() if initial_adapters(layer) is None)
    if missing:
        raise ValueError(
            f"lora init_lora_weights={init!r} rewrote the base weights, and the adapters as initialised were not"
            f" kept for {len(missing)} layers ({', '.join(missing[:3])}): the strategies keep them as LoRA is"
            " injected, which did not happen for this model. Export the merged model (--merged), or build the"
            " LoRA through LowPrecisionStrategy(lora=...)."
        )


def with_initial_adapters(key: str, tensor: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """The converted adapter's tensor for ``key``: ``[A; A0]`` for A's weight, ``[B | -B0]`` for B's."""
    a0, b0 = initial_adapters(layer)
    if ".lora_A." in key:
        return torch.cat([tensor, a0.to(tensor.dtype)], dim=0)
    if ".lora_B." in key:
        return torch.cat([tensor, -b0.to(tensor.dtype)], dim=1)
    return tensor


def rewrote_the_base_line(lora: Any) -> str:
    """The end of fit's LoRA line where the initialization rewrote the base: what each export then writes."""
    init = base_changing_init(lora)
    if init is None:
        return ""
    adapter = "a LoRA of twice the rank for the original base" if convertible_init(lora) else "refused"
    return (
        f" init_lora_weights={init!r} rewrote the base weights: the adapter export is {adapter},"
        " --merged the model as trained."
    )
