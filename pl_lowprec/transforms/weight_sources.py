"""Where a model's weights come from: ``pretrained=`` (the strategy's) or the module's own
``pretrained_weights``, streamed into a module built on the meta device; under FSDP without either, each
module's ``reset_parameters``. Also the init context that puts parameters on the meta device, and a teardown
that survives a module left there by a failed load."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import nn

from pl_lowprec.distributed.sharding import Sharding
from pl_lowprec.loading import PretrainedWeights, empty_weights, has_meta_tensors, load_pretrained
from pl_lowprec.loading.empty import storage_to_fill
from pl_lowprec.transforms.quantization import QuantizationConfig

_LOADED_FROM = "_pl_lowprec_loaded_from"  # the PretrainedWeights the module was filled from

QuantizeLayer = Callable[[nn.Linear, QuantizationConfig, torch.dtype, torch.device], nn.Module]


def weights_for(model: nn.Module, configured: PretrainedWeights | None) -> PretrainedWeights | None:
    """The strategy's ``pretrained=``, else what the module names as its ``pretrained_weights``; once loaded,
    with the prefix its keys were read with (the one taken where none was given: ``loading/key_match.py``)."""
    own = getattr(model, "pretrained_weights", None)
    if own is not None and not isinstance(own, PretrainedWeights):
        raise TypeError(f"{type(model).__name__}.pretrained_weights must be a PretrainedWeights, got {own!r}.")
    if configured is not None and own is not None and configured != own:
        raise ValueError(
            f"Two sources of pretrained weights: the strategy's pretrained={str(configured.path)!r} and"
            f" {type(model).__name__}.pretrained_weights={str(own.path)!r}. Name one."
        )
    named = configured or own
    loaded = getattr(model, _LOADED_FROM, None)
    return loaded if named is not None and loaded is not None and loaded.path == named.path else named


def fill_meta_model(
    model: nn.Module,
    weights: PretrainedWeights | None,
    quantization: QuantizationConfig | None,
    compute_dtype: torch.dtype,
    device: torch.device,
    quantize_layer: QuantizeLayer,
    sharding: Sharding | None,
    new_heads: tuple[str, ...] = (),
) -> None:
    """Fill a module built on the meta device from ``weights``, quantizing as it loads (``new_heads``, which the
    checkpoint may lack, initialized); once loaded, the module is marked and later calls change nothing. A module
    with real parameters is left as it is."""
    if not has_meta_tensors(model):
        if weights is not None and getattr(model, _LOADED_FROM, None) is None:
            raise ValueError(
                f"pretrained={str(weights.path)!r} needs {type(model).__name__} built without weights, but its"
                " parameters are real. Build them on the meta device: inside `configure_model` under"
                " `pl_lowprec.loading.empty_weights()`, or under `trainer.init_module(empty_init=True)`."
            )
        return
    if weights is None and sharding is not None:
        sharding.initialize(model, quantization, compute_dtype, device, quantize_layer)
        return
    if weights is None:
        raise ValueError(
            f"{type(model).__name__} has parameters on the meta device and nothing to fill them from: pass"
            " pretrained= (a safetensors file or model directory) to the strategy, or build it with weights."
        )
    place = sharding.placement() if sharding is not None else None
    report = load_pretrained(
        model,
        weights.path,
        weights.prefix,
        quantization,
        compute_dtype,
        device,
        quantize_layer,
        place,
        new_heads,
        weights.expected_prefix,
    )
    setattr(model, _LOADED_FROM, dataclasses.replace(weights, prefix=report.prefix))


def storage_for_the_checkpoint(
    model: nn.Module, weights: PretrainedWeights, device: torch.device, sharding: Sharding | None
) -> None:
    """Empty storage for a module whose every weight the checkpoint restored next sets (``checkpoint_fills.py``),
    marked as filled for ``weights``: nothing of it is read. Under FSDP2 each rank keeps its rows of it, as a
    streamed load keeps them."""
    storage_to_fill(model, device, sharding.empty_storage(device) if sharding is not None else None)
    setattr(model, _LOADED_FROM, weights)


@contextmanager
def _stacked(outer: AbstractContextManager, inner: AbstractContextManager) -> Iterator[None]:
    with outer, inner:
        yield


def meta_init_context(default: AbstractContextManager, weights: PretrainedWeights | None) -> AbstractContextManager:
    """Under ``trainer.init_module(empty_init=True)`` with ``pretrained=``, parameters go on the meta device."""
    if weights is None:
        return default
    return _stacked(default, empty_weights())


def teardown_with_meta(strategy: Any, teardown: Callable[[], None]) -> None:
    """Run the strategy's ``teardown`` even when a failed load left the module on the meta device.

    Lightning's teardown moves the module to the CPU, which meta tensors cannot do; that second error would
    hide the first (the one that names the bad checkpoint keys)."""
    module = strategy.lightning_module
    if module is None or not has_meta_tensors(module):
        teardown()
        return
    strategy._lightning_module = None
    try:
        teardown()
    finally:
        strategy._lightning_module = module
