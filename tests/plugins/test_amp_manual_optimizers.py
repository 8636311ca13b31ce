"""Manual optimization with several optimizers and one loss scaler equals PyTorch's plain loop for several
optimizers (https://pytorch.org/docs/stable/notes/amp_examples.html, "Working with Multiple Models, Losses, and
Optimizers"): each optimizer unscaled once and stepped once, then one ``scaler.update()`` per iteration, after
all of them stepped. Parameters are compared bit for bit, the scale exactly; ``growth_interval=2`` makes the
scale move within the few batches, so an update too many or too early shows."""

import warnings

import lightning.pytorch as pl
import pytest
import torch
from lightning_helpers import quiet_trainer
from plain_amp_loop import make_classification_data
from torch.nn import functional as F

from pl_lowprec import AMPPrecision

BATCHES, LR, GROWTH_INTERVAL = 6, 0.1, 2


def _loader(batches: int = BATCHES) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(make_classification_data(n=batches * 8), batch_size=8)


def _models() -> tuple[torch.nn.Linear, torch.nn.Linear]:
    torch.manual_seed(0)
    return torch.nn.Linear(32, 4), torch.nn.Linear(32, 4)


def _losses(a, b, x, y, i: int, overflow_at: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    l0, l1 = F.cross_entropy(a(x), y), F.cross_entropy(b(x), y)
    return (l0 * 1e30 if i in overflow_at else l0), l1  # only model a's gradients overflow


def _reference(order: str, clip: float | None, overflow_at: tuple[int, ...]):
    """The plain loop in ``order``, one ``scaler.update()`` per iteration: the models, the scaler, the number of
    steps applied and the scale after each back-off."""
    a, b = _models()
    o0, o1 = torch.optim.SGD(a.parameters(), lr=LR), torch.optim.SGD(b.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", growth_interval=GROWTH_INTERVAL)
    applied, backoffs = [], []
    for optimizer in (o0, o1):
        optimizer.register_step_post_hook(lambda *_: applied.append(1))

    def clip_(optimizer, model):
        if clip is not None:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)

    for i, (x, y) in enumerate(_loader()):
        with torch.autocast("cpu", dtype=torch.float16):
            l0, l1 = _losses(a, b, x, y, i, overflow_at)
        if order == "both_then_step":
            scaler.scale(l0).backward()
            scaler.scale(l1).backward()
            clip_(o0, a)
            clip_(o1, b)
            scaler.step(o0)
            scaler.step(o1)
        elif order == "clip_between":
            scaler.scale(l0).backward()
            clip_(o0, a)
            scaler.scale(l1).backward()
            clip_(o1, b)
            scaler.step(o0)
            scaler.step(o1)
        else:  # sequential, as in Lightning's GAN example
            scaler.scale(l0).backward()
            clip_(o0, a)
            scaler.step(o0)
            o0.zero_grad()
            scaler.scale(l1).backward()
            clip_(o1, b)
            scaler.step(o1)
        before = scaler.get_scale()
        scaler.update()
        if scaler.get_scale() < before:
            backoffs.append(scaler.get_scale())
        o0.zero_grad()
        o1.zero_grad()
    return a, b, scaler, len(applied), backoffs


class TwoModels(pl.LightningModule):
    """The same iteration through Lightning's manual optimization."""

    def __init__(self, order: str, clip: float | None, overflow_at: tuple[int, ...]) -> None:
        super().__init__()
        self.a, self.b = _models()
        self.order, self.clip, self.overflow_at = order, clip, overflow_at
        self.automatic_optimization = False

    def clip_(self, optimizer) -> None:
        if self.clip is not None:
            self.clip_gradients(optimizer, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")

    def training_step(self, batch, batch_idx):
        o0, o1 = self.optimizers()
        l0, l1 = _losses(self.a, self.b, *batch, batch_idx, self.overflow_at)
        if self.order == "both_then_step":
            self.manual_backward(l0)
            self.manual_backward(l1)
            self.clip_(o0)
            self.clip_(o1)
            o0.step()
            o1.step()
        elif self.order == "clip_between":
            self.manual_backward(l0)
            self.clip_(o0)
            self.manual_backward(l1)
            self.clip_(o1)
            o0.step()
            o1.step()
        else:
            self.manual_backward(l0)
            self.clip_(o0)
            o0.step()
            o0.zero_grad()
            self.manual_backward(l1)
            self.clip_(o1)
            o1.step()
        o0.zero_grad()
        o1.zero_grad()

    def configure_optimizers(self):
        return torch.optim.SGD(self.a.parameters(), lr=LR), torch.optim.SGD(self.b.parameters(), lr=LR)


@pytest.mark.parametrize(
    ("order", "clip", "overflow_at"),
    [
        ("both_then_step", 1.0, ()),
        ("both_then_step", None, (2,)),
        ("both_then_step", 1.0, (2,)),
        ("clip_between", 1.0, ()),
        ("clip_between", 1.0, (2,)),
        ("sequential", 1.0, (2,)),
    ],
)
def test_two_optimizers_match_the_plain_loop(order, clip, overflow_at):
    ref_a, ref_b, scaler, applied, backoffs = _reference(order, clip, overflow_at)
    plugin = AMPPrecision("16-mixed", growth_interval=GROWTH_INTERVAL)
    module = TwoModels(order, clip, overflow_at)
    quiet_trainer(plugins=[plugin], max_epochs=1).fit(module, _loader())

    ours, theirs = [*module.a.parameters(), *module.b.parameters()], [*ref_a.parameters(), *ref_b.parameters()]
    for mine, reference in zip(ours, theirs, strict=True):
        assert torch.equal(mine, reference)
    state = plugin.loss_scale_state()
    assert state.scale == scaler.get_scale()
    assert plugin._tracker.optimizer_steps == 2 * BATCHES
    assert state.skipped_steps == 2 * BATCHES - applied  # each optimizer skips only on its own overflow
    assert [scale for _, scale in plugin._tracker.backoffs] == backoffs  # one back-off per iteration at most


class InnerLoop(pl.LightningModule):
    """One optimizer stepped twice in one training_step (backward, step, zero_grad on each half of the batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, _ = _models()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        for x, y in zip(*(t.chunk(2) for t in batch), strict=True):
            self.manual_backward(F.cross_entropy(self.a(x), y))
            opt.step()
            opt.zero_grad()

    def configure_optimizers(self):
        return torch.optim.SGD(self.a.parameters(), lr=LR)


def test_one_optimizer_stepped_twice_in_a_training_step_updates_after_each_step():
    """Every optimizer has stepped, so the next backward starts a new iteration: the scale is updated before it,
    as the plain loop updates after each step (growth_interval=1: the scale grows at every update)."""
    a, _ = _models()
    optimizer = torch.optim.SGD(a.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    for x, y in _loader(3):
        for xh, yh in zip(x.chunk(2), y.chunk(2), strict=True):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(a(xh), yh)
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()

    plugin = AMPPrecision("16-mixed", init_scale=2.0**10, growth_interval=1)
    module = InnerLoop()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no scale changed between a backward and its unscale
        quiet_trainer(plugins=[plugin], max_epochs=1).fit(module, _loader(3))
    assert plugin.loss_scale_state().scale == scaler.get_scale() == 2.0**16
    for ours, theirs in zip(module.a.parameters(), a.parameters(), strict=True):
        assert torch.equal(ours, theirs)


class CriticTwice(TwoModels):
    """Model a's optimizer stepped twice in one training_step, with a backward in between, before model b's."""

    def training_step(self, batch, batch_idx):
        o0, o1 = self.optimizers()
        for _ in range(2):
            self.manual_backward(F.cross_entropy(self.a(batch[0]), batch[1]))
            o0.step()
            o0.zero_grad()
        self.manual_backward(F.cross_entropy(self.b(batch[0]), batch[1]))
        o1.step()
        o1.zero_grad()


def test_a_scale_change_between_a_backward_and_its_unscale_is_said():
    plugin = AMPPrecision("16-mixed", growth_interval=1)
    with pytest.warns(RuntimeWarning, match=r"SGD stepped twice in one training_step .* \(65536 -> 131072\)"):
        quiet_trainer(plugins=[plugin], max_epochs=1).fit(CriticTwice("", None, ()), _loader(1))
