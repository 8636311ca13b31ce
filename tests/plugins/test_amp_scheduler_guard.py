"""The scheduler guard holds a step-interval scheduler on a skipped step without changing what the scheduler is:
``self.lr_schedulers()`` still passes Lightning's documented ``isinstance`` checks, and its ``state_dict`` is the
scheduler's own. In manual optimization, a scheduler stepped by hand is held by the guard (``interval="step"``) or
by ``step_was_skipped``."""

from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning_helpers import quiet_trainer
from plain_amp_loop import make_classification_data, make_mlp
from torch.nn import functional as F
from torch.optim.lr_scheduler import ReduceLROnPlateau, StepLR

from pl_lowprec import AMPPrecision, SkipAwareScheduler
from pl_lowprec.plugins.scheduler_guard import guard_step_schedulers

OVERFLOW_AT, BATCHES = 1, 4


def _loader() -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(make_classification_data(n=BATCHES * 8), batch_size=8)


def _loss(model, x, y, i) -> torch.Tensor:
    loss = F.cross_entropy(model(x), y)
    return loss * 1e30 if i == OVERFLOW_AT else loss


def _reference(plateau: bool) -> tuple[torch.nn.Module, list[float]]:
    """The plain loop that steps the scheduler only after an applied step (the scale did not back off)."""
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = ReduceLROnPlateau(optimizer, patience=0, factor=0.5) if plateau else StepLR(optimizer, 1, 0.5)
    scaler = torch.amp.GradScaler("cpu")
    lrs = []
    for i, (x, y) in enumerate(_loader()):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = _loss(model, x, y, i)
        scaler.scale(loss).backward()
        before = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        if scaler.get_scale() >= before:
            scheduler.step(loss.detach()) if plateau else scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    return model, lrs


class HandStepped(pl.LightningModule):
    """Lightning's manual-optimization pattern: the scheduler stepped by hand after each optimizer step."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.model = make_mlp()
        self.how = how
        self.automatic_optimization = False
        self.lrs: list[float] = []

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = _loss(self.model, *batch, batch_idx)
        self.manual_backward(loss)
        opt.step()
        opt.zero_grad()
        sch = self.lr_schedulers()
        if isinstance(sch, ReduceLROnPlateau):  # Lightning's documented check
            sch.step(loss.detach())
        elif self.how == "step_was_skipped":
            if not self.trainer.precision_plugin.step_was_skipped(opt):
                sch.step()
        else:
            raise AssertionError(f"self.lr_schedulers() is a {type(sch).__mro__}, not a ReduceLROnPlateau")
        self.lrs.append(opt.param_groups[0]["lr"])

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=1.0)
        if self.how == "plateau":
            scheduler = {"scheduler": ReduceLROnPlateau(opt, patience=0, factor=0.5), "interval": "step"}
        else:  # returned plainly: Lightning's interval="epoch", not guarded
            scheduler = StepLR(opt, 1, 0.5)
        return {"optimizer": opt, "lr_scheduler": scheduler}


@pytest.mark.parametrize("how", ["plateau", "step_was_skipped"])
def test_a_hand_stepped_scheduler_is_held_on_a_skipped_step(how):
    reference, lrs = _reference(plateau=how == "plateau")
    plugin = AMPPrecision("16-mixed")
    module = HandStepped(how)
    trainer = quiet_trainer(plugins=[plugin], max_epochs=1)
    trainer.fit(module, _loader())

    assert plugin.loss_scale_state().skipped_steps == 1
    assert module.lrs == lrs
    assert len(set(lrs)) > 1  # the schedule moved, and held on the overflowing batch
    for ours, theirs in zip(module.model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours, theirs)
    scheduler = trainer.lr_scheduler_configs[0].scheduler
    assert isinstance(scheduler, SkipAwareScheduler) == (how == "plateau")


def test_the_guard_leaves_the_schedulers_class_name_and_state_alone():
    optimizer = torch.optim.SGD(make_mlp().parameters(), lr=1.0)
    plain = ReduceLROnPlateau(optimizer)
    config = SimpleNamespace(interval="step", scheduler=ReduceLROnPlateau(optimizer))  # Lightning's config
    guard_step_schedulers([config], lambda optimizer: True)  # every step skipped
    guarded = config.scheduler

    assert isinstance(guarded, ReduceLROnPlateau) and isinstance(guarded, SkipAwareScheduler)
    assert type(guarded).__name__ == "ReduceLROnPlateau"
    assert type(plain) is ReduceLROnPlateau  # another scheduler of the class is not guarded
    assert guarded.state_dict() == plain.state_dict()
    guarded.step(1.0)  # held
    assert guarded.state_dict() == plain.state_dict()


def test_a_guarded_scheduler_pickles_as_its_own_class():
    """The guard's class is named as the scheduler's, which pickle refused ("not the same object as
    torch.optim.lr_scheduler.StepLR"): torch.save of a scheduler, or of an object holding one, failed."""
    import pickle

    optimizer = torch.optim.SGD(make_mlp().parameters(), lr=1.0)
    config = SimpleNamespace(interval="step", scheduler=torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5))
    guard_step_schedulers([config], lambda optimizer: False)
    config.scheduler.step()
    restored = pickle.loads(pickle.dumps(config.scheduler))
    assert type(restored) is torch.optim.lr_scheduler.StepLR
    assert restored.state_dict() == config.scheduler.state_dict() and restored.get_last_lr() == [0.5]
