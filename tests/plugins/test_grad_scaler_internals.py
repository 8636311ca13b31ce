"""GradScaler's private state is touched in one documented module, and what it does there holds on this torch."""

import re
from pathlib import Path

import pytest
import torch
import warm_python

import pl_lowprec
from pl_lowprec.plugins import grad_scaler_internals
from pl_lowprec.plugins.grad_scaler_internals import check_scaler_internals, forget_unscale
from pl_lowprec.plugins.loss_scale_config import LossScaleConfig
from pl_lowprec.plugins.scaler_bookkeeping import ScalerBookkeeping

PACKAGE = Path(pl_lowprec.__file__).parent
# Private names of torch.amp.GradScaler (torch 2.13.0); none may be used outside grad_scaler_internals.py.
PRIVATE_FIELDS = re.compile(
    r"\._(per_optimizer_states|scale|growth_tracker|init_scale|growth_factor|backoff_factor|growth_interval"
    r"|init_growth_tracker|enabled|per_device_tensors|unscale_grads_|maybe_opt_step|check_inf_per_device"
    r"|lazy_init_scale_growth_tracker|get_scale_async|get_growth_tracker)\b"
)


def test_only_grad_scaler_internals_touches_private_scaler_state():
    touching = {
        str(path.relative_to(PACKAGE))
        for path in PACKAGE.rglob("*.py")
        if PRIVATE_FIELDS.search(path.read_text()) and "scaler" in path.read_text()
    }
    assert touching == {"plugins/grad_scaler_internals.py"}
    assert grad_scaler_internals.CHECKED_TORCH_VERSION in grad_scaler_internals.__doc__


def _unscaled_optimizer() -> tuple[torch.amp.GradScaler, torch.optim.Optimizer, torch.nn.Linear]:
    layer = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    scaler.scale(layer(torch.ones(1, 3)).sum()).backward()
    scaler.unscale_(optimizer)
    return scaler, optimizer, layer


def test_forget_unscale_returns_the_optimizer_to_ready_without_touching_the_scale():
    scaler, optimizer, layer = _unscaled_optimizer()
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(optimizer)
    forget_unscale(scaler, id(optimizer))
    layer.weight.grad.fill_(8.0)
    scaler.unscale_(optimizer)  # allowed again, and it unscales the fresh gradients
    torch.testing.assert_close(layer.weight.grad, torch.ones_like(layer.weight))
    assert scaler.get_scale() == 8.0


def test_a_torch_without_the_field_fails_when_the_scaler_is_built(monkeypatch):
    class ChangedGradScaler(torch.amp.GradScaler):  # a torch release that renamed the field
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            del self._per_optimizer_states

    check_scaler_internals()
    monkeypatch.setattr(torch.amp, "GradScaler", ChangedGradScaler)
    with pytest.raises(RuntimeError, match=r"_per_optimizer_states.*checked against torch 2\.13\.0"):
        ScalerBookkeeping(torch.amp.GradScaler("cpu"))


def test_bookkeeping_unscales_once_and_sees_a_skipped_step():
    scaler, optimizer, layer = _unscaled_optimizer()
    forget_unscale(scaler, id(optimizer))
    steps = ScalerBookkeeping(scaler)
    steps.watch([optimizer])
    steps.unscale_once(optimizer)
    steps.unscale_once(optimizer)  # a second call (clip, then step) does not unscale twice
    assert steps.unscaled == {id(optimizer)}
    _, skipped = steps.step(optimizer)
    steps.update()
    assert not skipped and steps.unscaled == set()

    optimizer.zero_grad()
    scaler.scale(layer(torch.full((1, 3), float("inf"))).sum()).backward()
    steps.unscale_once(optimizer)
    _, skipped = steps.step(optimizer)
    steps.update()
    assert skipped and steps.step_was_skipped(optimizer) and scaler.get_scale() == 4.0
    steps.release()


def test_loss_scale_config_is_frozen_and_checked_when_built():
    config = LossScaleConfig("16-mixed", loss_scale=256)
    assert config.mode("16-mixed") == "static" and config.static_scale == 256.0
    assert config.mode("bf16-mixed") is None
    with pytest.raises(AttributeError):
        config.loss_scale = "dynamic"  # type: ignore[misc]
    with pytest.raises(ValueError, match=r"growth_factor=1\.0 must be > 1\.0"):
        LossScaleConfig("auto", growth_factor=1.0)
    assert LossScaleConfig("auto", growth_interval=50).changed_settings() == "growth_interval=50"


def _step_with_inf_on_rank_one(rank, path, out):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    torch.manual_seed(0)
    layer = torch.nn.Linear(3, 2)
    before = layer.weight.detach().clone()
    optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    steps = ScalerBookkeeping(scaler)
    steps.watch([optimizer])
    scaler.scale(layer(torch.ones(1, 3)).sum()).backward()  # the same (all-reduced) gradients on both ranks...
    if rank == 1:
        layer.weight.grad[0, 0] = float("inf")  # ...then an inf on rank 1 only, after the all-reduce
    steps.unscale_once(optimizer)
    _, skipped = steps.step(optimizer)
    steps.update()
    steps.release()
    dist.destroy_process_group()
    unchanged = torch.equal(layer.weight, before)
    torch.save({"skipped": skipped, "unchanged": unchanged, "scale": scaler.get_scale()}, out[rank])


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path):
    """GradScaler decided per process: rank 1 skipped and halved its scale, rank 0 applied the step and kept its
    scale, so the DDP replicas parted silently and rank zero (the one that logs) reported no skip."""
    out = [str(tmp_path / f"rank{r}.pt") for r in range(2)]
    warm_python.spawn(_step_with_inf_on_rank_one, args=(str(tmp_path / "rendezvous"), out), nprocs=2)
    ranks = [torch.load(path) for path in out]
    assert ranks[0] == ranks[1] == {"skipped": True, "unchanged": True, "scale": 4.0}
