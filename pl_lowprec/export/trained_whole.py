"""Weights a fine-tune trained as they are, not through LoRA: a task's head in ``modules_to_save`` (a classifier's
``score``), biases under ``bias='all'``. A merged export writes them as they trained, under the keys the plain
model has, which peft's wrappers hide (``score.modules_to_save.default.weight``, ``q_proj.base_layer.bias``),
and the output head that training untied from a trained copy of the input embeddings."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from pl_lowprec.distributed.mesh import full_tensor
from pl_lowprec.loading.sources import TensorInfo, map_key, prefix_map
from pl_lowprec.transforms.lora import left_tied_to_originals, plain_key


def trained_whole(module: nn.Module) -> dict[str, torch.Tensor]:
    """``{plain key: full tensor}`` of every trainable parameter that is not a LoRA factor (gathered on FSDP)."""
    return {
        plain_key(name): full_tensor(param.detach()).cpu()
        for name, param in module.named_parameters()
        if param.requires_grad and "lora_" not in name
    }


def untied_heads(module: nn.Module) -> dict[str, torch.Tensor]:
    """``{plain key: weight}`` of each module that training untied from a trained copy (a tied ``lm_head`` under a
    trained ``embed_tokens``, which keeps the original rows): a merged model that tied them again would run the
    trained rows in both places, so each is written as its own tensor."""
    return {
        plain_key(f"{name}.weight"): full_tensor(module.get_submodule(name).weight.detach()).cpu()
        for name in left_tied_to_originals(module)
    }


def file_key_of(module_key: str, prefix: str | Mapping[str, str] | None, source: Path) -> str:
    """The checkpoint key that ``prefix`` maps onto ``module_key``: where a new head's tensor is written."""
    prefixes = prefix_map(prefix)
    for old, new in sorted(prefixes.items(), key=lambda item: len(item[1]), reverse=True):
        if module_key.startswith(new) and map_key(old + module_key[len(new) :], prefixes) == module_key:
            return old + module_key[len(new) :]
    raise ValueError(
        f"{module_key} trained whole and is not in pretrained={str(source)!r}, and under pretrained_prefix="
        f"{prefix!r} no checkpoint key would load it back: a merged model can only hold the checkpoint's own"
        " model. Export an adapter directory (leave out --merged), or keep that weight inside the pretrained model."
    )


def without_absent_modules(module: nn.Module, tensors: Mapping[str, TensorInfo]) -> set[str]:
    """The checkpoint's keys whose module the trained model has: a causal LM's ``lm_head`` under a classifier's
    ``score`` is left out of the merged model, as the classifier's own ``save_pretrained`` leaves it out."""
    modules = {name for name, _ in module.named_modules()}
    return {key for key in tensors if "." not in key or key.rpartition(".")[0] in modules}
