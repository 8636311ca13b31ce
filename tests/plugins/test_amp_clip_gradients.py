"""``AMPPrecision.clip_gradients`` in Lightning's order: disabled clipping touches nothing, an optimizer that
unscales inside its own step is refused before any unscale, and otherwise gradients are unscaled once, then
clipped."""

import pytest
import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities import GradClipAlgorithmType

from pl_lowprec import AMPPrecision

SCALE = 2.0**16  # a power of two: unscaling is exact, so gradients compare bit for bit
ALGORITHMS = [GradClipAlgorithmType.NORM, GradClipAlgorithmType.VALUE]


def _scaled_gradients(plugin: AMPPrecision, **optimizer_kwargs) -> tuple[torch.nn.Linear, torch.optim.Optimizer]:
    """A layer whose gradients went through ``plugin``'s scaler (when it has one), and its AdamW."""
    layer = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(layer.parameters(), lr=0.1, **optimizer_kwargs)
    loss = layer(torch.randn(5, 4)).pow(2).sum()
    (plugin.scaler.scale(loss) if plugin.scaler is not None else loss).backward()
    return layer, optimizer


def _gradients(layer: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in layer.parameters()]


def _assert_bit_identical(layer: torch.nn.Module, before: list[torch.Tensor]) -> None:
    for grad, expected in zip((p.grad for p in layer.parameters()), before, strict=True):
        assert torch.equal(grad, expected)


def _assert_scaler_untouched(plugin: AMPPrecision, optimizer: torch.optim.Optimizer, state: dict) -> None:
    assert plugin._steps.unscaled == set()
    assert plugin.scaler.state_dict() == state
    plugin.scaler.unscale_(optimizer)  # still allowed: GradScaler holds no unscale for this optimizer


class UnreadableOptimizer:
    """Fails the test on any attribute read: disabled clipping must not look at the optimizer."""

    def __getattribute__(self, name: str):
        raise AssertionError(f"clip_gradients read optimizer.{name} with clipping disabled")


@pytest.mark.parametrize("clip_val", [0, 0.0, None])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_disabled_clipping_reads_nothing_and_changes_nothing(clip_val, algorithm):
    plugin = AMPPrecision("16-mixed", init_scale=SCALE, device="cpu")
    plugin.clip_gradients(UnreadableOptimizer(), clip_val, algorithm)

    # a fused optimizer too: disabled clipping is no reason to refuse it
    layer, optimizer = _scaled_gradients(plugin, fused=True)
    before, state = _gradients(layer), plugin.scaler.state_dict()
    plugin.clip_gradients(optimizer, clip_val, algorithm)
    _assert_bit_identical(layer, before)
    _assert_scaler_untouched(plugin, optimizer, state)


@pytest.mark.parametrize("wrap", [False, True], ids=["optimizer", "lightning_optimizer"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_optimizer_that_unscales_in_its_step_is_refused_before_anything_is_unscaled(wrap, algorithm):
    plugin = AMPPrecision("16-mixed", init_scale=SCALE, device="cpu")
    layer, optimizer = _scaled_gradients(plugin, fused=True)
    assert optimizer._step_supports_amp_scaling
    clipped = LightningOptimizer(optimizer) if wrap else optimizer  # manual optimization passes the wrapper
    before, state = _gradients(layer), plugin.scaler.state_dict()
    with pytest.raises(RuntimeError) as lightning_error:
        MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu")).clip_gradients(clipped, 1.0, algorithm)

    with pytest.raises(RuntimeError) as error:
        plugin.clip_gradients(clipped, 1.0, algorithm)

    assert str(error.value) == str(lightning_error.value)
    assert f"The current optimizer, {type(clipped).__qualname__}, does not allow for gradient clipping" in str(
        error.value
    )
    assert "HINT: Are you using a 'fused' optimizer?" in str(error.value)
    _assert_bit_identical(layer, before)
    _assert_scaler_untouched(plugin, optimizer, state)


def _clipped_reference(gradients: list[torch.Tensor], clip_val: float, algorithm) -> list[torch.Tensor]:
    """What torch's own clipping makes of ``gradients``."""
    parameters = [torch.nn.Parameter(torch.zeros_like(grad)) for grad in gradients]
    for parameter, grad in zip(parameters, gradients, strict=True):
        parameter.grad = grad.clone()
    if algorithm == GradClipAlgorithmType.VALUE:
        torch.nn.utils.clip_grad_value_(parameters, clip_val)
    else:
        torch.nn.utils.clip_grad_norm_(parameters, clip_val)
    return [parameter.grad for parameter in parameters]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_enabled_clipping_unscales_once_then_clips(algorithm):
    plugin = AMPPrecision("16-mixed", init_scale=SCALE, device="cpu")
    layer, optimizer = _scaled_gradients(plugin)
    unscaled = [grad / SCALE for grad in _gradients(layer)]
    if algorithm == GradClipAlgorithmType.VALUE:
        size = float(max(grad.abs().max() for grad in unscaled))
    else:
        size = float(torch.linalg.vector_norm(torch.cat([grad.flatten() for grad in unscaled])))

    # A threshold above the unscaled size (far below the scaled one) leaves the unscaled gradients as they are.
    plugin.clip_gradients(optimizer, 2.0 * size, algorithm)
    _assert_bit_identical(layer, unscaled)
    assert plugin._steps.unscaled == {id(optimizer)}

    # A second clip, and the step's unscale after it, do not unscale again: a tighter threshold clips the
    # unscaled values exactly as torch's clipping does.
    plugin.clip_gradients(optimizer, 0.5 * size, algorithm)
    plugin._steps.unscale_once(optimizer)
    _assert_bit_identical(layer, _clipped_reference(unscaled, 0.5 * size, algorithm))
