"""Build a module with its parameters on the meta device and its buffers real.

``torch.device("meta")`` also puts buffers on the meta device, and the non-persistent ones (a rotary
embedding's ``inv_freq``) are in no checkpoint, so nothing could fill them. Like accelerate's
``init_empty_weights(include_buffers=False)``, this moves only parameters to the meta device: they cost no
memory and are filled by ``load_pretrained``; buffers are computed by the module's own ``__init__``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn


@contextmanager
def empty_weights() -> Iterator[None]:
    """Every parameter registered inside this block lives on the meta device (no storage)."""
    register = nn.Module.register_parameter

    def register_on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            kept = module._parameters[name]
            extra = dict(kept.__dict__)
            extra["requires_grad"] = kept.requires_grad
            module._parameters[name] = type(kept)(kept.to("meta"), **extra)

    nn.Module.register_parameter = register_on_meta
    try:
        yield
    finally:
        nn.Module.register_parameter = register


def has_meta_tensors(module: nn.Module) -> bool:
    return any(t.device.type == "meta" for t in (*module.parameters(), *module.buffers()))


def meta_tensor_names(module: nn.Module) -> list[str]:
    named = (*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False))
    return [name for name, t in named if t.device.type == "meta"]


def assert_no_meta(module: nn.Module) -> None:
    """Fail with names when something is still on the meta device after loading."""
    left = meta_tensor_names(module)
    if left:
        raise ValueError(
            f"After loading pretrained weights, {len(left)} tensors of {type(module).__name__} are still on the"
            f" meta device and in no checkpoint file: {', '.join(left[:8])}{', ...' if len(left) > 8 else ''}."
            " These are non-persistent buffers: build the module under `pl_lowprec.loading.empty_weights()`"
            " (parameters on meta, buffers real) or `trainer.init_module(empty_init=True)` instead of"
            " `torch.device('meta')`."
        )


def is_meta(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "meta"


def reset_on(module: nn.Module, device: torch.device) -> None:
    """Give a module's own meta parameters storage on ``device`` and set them as its ``reset_parameters()`` does:
    a module that no checkpoint fills (FSDP2's initialization without ``pretrained=``, a new task head)."""
    module.to_empty(device=device, recurse=False)
    with torch.no_grad():
        module.reset_parameters()


def storage_to_fill(
    module: nn.Module,
    device: torch.device | str = "cpu",
    empty_of: Callable[[nn.Parameter], torch.Tensor] | None = None,
) -> None:
    """Give every meta parameter uninitialized storage on ``device``, in its dtype, tied parameters staying one: for
    a load that copies every value in next (Lightning's ``load_state_dict`` of a checkpoint holding every weight), so
    that nothing is read twice. ``empty_of``: the storage of one, where a rank keeps only part of it (under FSDP2,
    its rows: ``mesh.empty_local_rows``), as a streamed load keeps it."""

    def empty(param: nn.Parameter) -> nn.Parameter:
        storage = empty_of(param) if empty_of is not None else torch.empty_like(param, device=device)
        return nn.Parameter(storage, param.requires_grad)

    replace_parameters(module, is_meta, empty)


def replace_parameters(
    module: nn.Module, chosen: Callable[[nn.Parameter], bool], replacement: Callable[[nn.Parameter], nn.Parameter]
) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """Replace every parameter ``chosen`` picks by ``replacement(param)``, made once for each parameter so that tied
    ones stay one; return each place replaced as ``(owner, attribute, the parameter it held)``."""
    replaced, made = [], {}
    for owner in module.modules():
        for attr, param in list(owner._parameters.items()):
            if param is None or not chosen(param):
                continue
            replaced.append((owner, attr, param))
            if id(param) not in made:
                made[id(param)] = replacement(param)
            owner._parameters[attr] = made[id(param)]
    return replaced


def place_own(module: nn.Module, place: Callable[[nn.Parameter], nn.Parameter]) -> None:
    """Replace each of a module's own parameters by what ``place`` keeps of it (under FSDP2, this rank's rows)."""
    for attr, param in list(module.named_parameters(recurse=False)):
        module._parameters[attr] = place(param)
