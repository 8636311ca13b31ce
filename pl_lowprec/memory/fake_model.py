"""Turning a transformed meta-device model into fake CPU tensors, and the one transformers quirk that needs.

Fake tensors have shapes, dtypes and a device but no storage, so a model larger than the machine costs nothing.
The model is built and transformed on the meta device (peft cannot inject adapters under ``FakeTensorMode``) and
made fake only for the step.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers are on the meta device, made without copying any weight
    (tied parameters stay tied)."""
    memo: dict[int, object] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        empty = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(empty, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty
    return copy.deepcopy(module, memo)


@contextmanager
def fake_tensors(model: nn.Module) -> Iterator[None]:
    """Inside ``FakeTensorMode``: the model's meta tensors are fake CPU tensors, and meta again afterwards."""
    saved = [(m, dict(m._parameters), dict(m._buffers), dict(vars(m))) for m in model.modules()]
    materialize_fake(model)
    try:
        yield
    finally:
        for module, parameters, buffers, attributes in saved:
            module._parameters.clear()
            module._parameters.update(parameters)
            module._buffers.clear()
            module._buffers.update(buffers)
            for name, value in attributes.items():
                if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter):
                    setattr(module, name, value)


def materialize_fake(model: nn.Module) -> None:
    """Replace meta tensors by fake CPU tensors (call inside ``FakeTensorMode``); tied tensors stay tied, and
    plain tensor attributes (rotary embeddings' ``original_inv_freq``) are made too."""
    made: dict[int, torch.Tensor] = {}

    def fake(tensor: torch.Tensor, parameter: bool) -> torch.Tensor:
        if id(tensor) not in made:
            empty = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
            made[id(tensor)] = nn.Parameter(empty, tensor.requires_grad) if parameter else empty
        return made[id(tensor)]

    for module in model.modules():
        for name, tensor in module._parameters.items():
            if tensor is not None and tensor.is_meta:
                module._parameters[name] = fake(tensor, True)
        for name, tensor in module._buffers.items():
            if tensor is not None and tensor.is_meta:
                module._buffers[name] = fake(tensor, False)
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and value.is_meta:
                setattr(module, name, fake(value, False))


@contextmanager
def eager_attention_masks() -> Iterator[None]:
    """Make transformers build the attention mask it builds in eager mode.

    On fake tensors transformers believes it is being traced: it looks for packed sequences and builds an explicit
    [B, 1, T, T] mask that SDPA turns into a float mask saved in every layer (+3.7% on a tiny model, growing with
    T squared), where the eager run with an unpadded batch passes ``is_causal=True`` and no mask. The estimate
    therefore assumes unpadded, unpacked batches.
    """
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    names = ("find_packed_sequence_indices", "is_tracing", "fast_all")
    saved = {name: getattr(masking_utils, name, None) for name in names}
    masking_utils.find_packed_sequence_indices = lambda position_ids: None
    masking_utils.is_tracing = lambda tensor=None: False
    masking_utils.fast_all = lambda tensor: True
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is not None:
                setattr(masking_utils, name, value)
