"""Step by step, ``AMPPrecision('16-mixed')`` is torch's GradScaler loop: the same scale after every step (back-offs
on forced overflows, growth after ``growth_interval`` clean steps), the same parameters and optimizer state bit
for bit, a skipped step leaving both untouched. The LR scheduler is where it parts from Lightning on purpose: it
holds on a skipped step, as Hugging Face's Trainer does (``if not optimizer_step_was_skipped: scheduler.step()``);
Lightning's ``MixedPrecision`` steps it anyway, which ``skip_scheduler_on_overflow=False`` keeps."""

import copy

import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning_helpers import Classifier, StepRecorder, quiet_trainer
from plain_amp_loop import make_classification_data, make_mlp
from torch.nn import functional as F

from pl_lowprec import AMPPrecision

STEPS, OVERFLOW_AT, LR, GAMMA = 8, (2, 3), 1e-2, 0.9
SCALER = {"init_scale": 1024.0, "growth_interval": 2}


def _loader() -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(make_classification_data(n=STEPS * 8), batch_size=8)


def _reference(model: torch.nn.Module, hold_scheduler: bool):
    """torch's AMP loop with Classifier's optimizer and schedule; entry k of each list: after k steps."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=GAMMA)
    scaler = torch.amp.GradScaler("cpu", **SCALER)
    rec = StepRecorder()
    rec.scales = [scaler.get_scale()]
    snapshot = lambda: (  # noqa: E731
        rec.params.append({f"model.{k}": v.detach().clone() for k, v in model.named_parameters()}),
        rec.optim_states.append(copy.deepcopy(optimizer.state_dict()["state"])),
        rec.lrs.append(optimizer.param_groups[0]["lr"]),
    )
    snapshot()
    for step, (x, y) in enumerate(_loader()):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        if step in OVERFLOW_AT:
            next(model.parameters()).grad.fill_(float("inf"))
        scaler.unscale_(optimizer)
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        skipped = scaler.get_scale() < scale
        if not (hold_scheduler and skipped):
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        rec.scales.append(scaler.get_scale())
        snapshot()
    return rec


class ScaleRecorder(StepRecorder):
    def on_train_start(self, trainer, pl_module) -> None:
        self.scales = [trainer.precision_plugin.scaler.get_scale()]
        super().on_train_start(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.scales.append(trainer.precision_plugin.scaler.get_scale())
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)


PLUGINS = {
    "amp": (lambda: AMPPrecision("16-mixed", **SCALER), True),
    "amp_scheduler_runs_ahead": (lambda: AMPPrecision("16-mixed", skip_scheduler_on_overflow=False, **SCALER), False),
    "lightning": (lambda: MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", **SCALER)), False),
}


@pytest.mark.parametrize(("plugin", "holds_scheduler"), PLUGINS.values(), ids=PLUGINS.keys())
def test_every_step_equals_torchs_grad_scaler_loop(plugin, holds_scheduler):
    model = make_mlp()
    reference = _reference(copy.deepcopy(model), hold_scheduler=holds_scheduler)
    ours = ScaleRecorder()
    trainer = quiet_trainer(plugins=[plugin()], max_steps=STEPS, callbacks=[ours])
    trainer.fit(Classifier(model, lr=LR, scheduler=True, overflow_at_steps=OVERFLOW_AT), _loader())

    # back-offs at the two overflows, growth after each 2 clean steps
    assert reference.scales == [1024, 1024, 2048, 1024, 512, 512, 1024, 1024, 2048]
    assert ours.scales == reference.scales
    for k in range(STEPS + 1):
        for name, value in reference.params[k].items():
            torch.testing.assert_close(ours.params[k][name], value, rtol=0, atol=0, msg=f"step {k} {name}")
        assert ours.optim_states[k].keys() == reference.optim_states[k].keys()
        for index, state in reference.optim_states[k].items():
            for key, value in state.items():
                torch.testing.assert_close(ours.optim_states[k][index][key], value, rtol=0, atol=0)
    assert ours.lrs == pytest.approx(reference.lrs, rel=0, abs=0)
    for k in (3, 4):  # the skipped steps: nothing moved
        assert all(torch.equal(ours.params[k][n], ours.params[k - 1][n]) for n in ours.params[k])
    assert (ours.lrs[3] == ours.lrs[2]) is holds_scheduler
