"""Batches that contribute nothing under a loss scaler: ``training_step`` returning ``None``, a clip with no step,
an exception mid-step. Each must leave the scaler consistent, and the run must equal a plain loop that skips
the same batches (parameters compared bit for bit)."""

import lightning.pytorch as pl
import pytest
import torch
from lightning_helpers import Classifier, quiet_trainer
from plain_amp_loop import make_classification_data, make_mlp
from torch.nn import functional as F

from pl_lowprec import AMPPrecision

BATCH = 8


def _loader(n: int) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(make_classification_data(n=n * BATCH), batch_size=BATCH)


def _reference(batches, skip: set[int], accumulate: int, clip: float | None, schedule: bool = True) -> tuple[dict, int]:
    """The plain AMP loop where skipped batches run no backward; a window steps if any batch left gradients."""
    model = make_mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    scaler = torch.amp.GradScaler("cpu")
    applied = 0
    for i, (x, y) in enumerate(batches):
        if i not in skip:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = F.cross_entropy(model(x), y)
            scaler.scale(loss / accumulate).backward()
        if (i + 1) % accumulate == 0:
            if any(p.grad is not None for p in model.parameters()):
                scaler.unscale_(optimizer)
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                scaler.step(optimizer)
                scaler.update()
                if schedule:
                    scheduler.step()
                applied += 1
            optimizer.zero_grad(set_to_none=True)
    return {f"model.{k}": v for k, v in model.state_dict().items()}, applied


class SkippingClassifier(Classifier):
    """Returns ``None`` from ``training_step`` for the listed batches (the usual way to drop a bad batch)."""

    def __init__(self, skip: set[int], **kwargs) -> None:
        super().__init__(make_mlp(), **kwargs)
        self.skip = skip

    def training_step(self, batch, batch_idx):
        if batch_idx in self.skip:
            return None
        return super().training_step(batch, batch_idx)


class ManualSkippingClassifier(Classifier):
    """Manual optimization; ``skip`` batches run no backward, ``clip_no_step`` ones unscale (clip) but never step."""

    def __init__(self, skip: set[int], clip_no_step: set[int], clip: float) -> None:
        super().__init__(make_mlp())
        self.automatic_optimization = False
        self.skip, self.clip_no_step, self.clip = skip, clip_no_step, clip

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        if batch_idx in self.skip:
            return None
        x, y = batch
        self.manual_backward(F.cross_entropy(self(x), y))
        self.clip_gradients(opt, gradient_clip_val=self.clip, gradient_clip_algorithm="norm")
        if batch_idx not in self.clip_no_step:
            opt.step()
        opt.zero_grad(set_to_none=True)


def _assert_params_equal(module: pl.LightningModule, expected: dict) -> None:
    for name, param in module.named_parameters():
        torch.testing.assert_close(param.detach(), expected[name], rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("clip", [None, 1.0])
@pytest.mark.parametrize(
    ("accumulate", "skip"),
    [
        (1, {2, 5}),
        # windows [0,1,2] [3,4,5] [6,7,8]: the first two end with a skipped batch, the last is empty
        (3, {2, 4, 6, 7, 8}),
    ],
)
def test_training_step_returning_none_contributes_nothing(accumulate, skip, clip):
    loader = _loader(9 if accumulate == 3 else 6)
    expected, applied = _reference(loader, skip, accumulate, clip)
    plugin = AMPPrecision("16-mixed")
    module = SkippingClassifier(skip, scheduler=True)
    trainer = quiet_trainer(plugins=[plugin], max_epochs=1, accumulate_grad_batches=accumulate, gradient_clip_val=clip)
    trainer.fit(module, loader)

    _assert_params_equal(module, expected)
    state = plugin.loss_scale_state()
    assert state.overflows == state.skipped_steps == 0  # a skipped batch is not an overflow
    assert plugin._tracker.optimizer_steps == applied  # ... nor a step when it left nothing to apply
    assert state.scale == 2.0**16
    # the step-interval schedule advanced once per applied update, not for the empty window
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-2 * 0.9**applied)


def test_manual_optimization_skips_and_clips_without_stepping():
    loader = _loader(6)
    # batch 1 runs no backward; batch 3 unscales for its clip, then its step is dropped
    expected, applied = _reference(loader, skip={1, 3}, accumulate=1, clip=1.0, schedule=False)
    plugin = AMPPrecision("16-mixed")
    module = ManualSkippingClassifier(skip={1}, clip_no_step={3}, clip=1.0)
    quiet_trainer(plugins=[plugin], max_epochs=1).fit(module, loader)

    _assert_params_equal(module, expected)
    assert plugin._tracker.optimizer_steps == applied == 4
    assert plugin.loss_scale_state().skipped_steps == 0


class FailOnceBeforeStep(pl.Callback):
    """Raises between ``unscale_`` and ``optimizer.step`` at one global step, as a user callback might."""

    def __init__(self, at_step: int) -> None:
        self.at_step = at_step

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == self.at_step:
            self.at_step = -1
            raise RuntimeError("boom between unscale_ and step")


def test_exception_between_unscale_and_step_leaves_the_scaler_ready():
    loader = _loader(4)
    plugin = AMPPrecision("16-mixed")
    module = Classifier(make_mlp())
    trainer = quiet_trainer(plugins=[plugin], max_steps=4, callbacks=[FailOnceBeforeStep(at_step=2)])
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit(module, loader)
    optimizer = trainer.optimizers[0]
    assert plugin._steps.unscaled == set()
    # GradScaler is back to its ready state for this optimizer: a new unscale_ is allowed
    optimizer.zero_grad(set_to_none=True)
    module(next(iter(loader))[0]).sum().backward()
    plugin.scaler.unscale_(optimizer)
    assert plugin._tracker.optimizer_steps == 2  # the failed step was not counted


class ValidatingClassifier(Classifier):
    """Counts its training micro-batches, and notes where each validation batch ran: (micro-batches, steps)."""

    def __init__(self) -> None:
        super().__init__(make_mlp())
        self.micro_batches, self.validated_at = 0, []

    def training_step(self, batch, batch_idx):
        self.micro_batches += 1
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch, batch_idx):
        self.validated_at.append((self.micro_batches, self.trainer.global_step))
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))


def test_validation_inside_an_accumulation_window_changes_nothing():
    loader = _loader(8)
    expected, applied = _reference(loader, skip=set(), accumulate=4, clip=1.0, schedule=False)
    module = ValidatingClassifier()
    trainer = quiet_trainer(
        plugins=[AMPPrecision("16-mixed")],
        max_epochs=1,
        accumulate_grad_batches=4,
        gradient_clip_val=1.0,
        val_check_interval=2,
        num_sanity_val_steps=0,
    )
    trainer.fit(module, loader, val_dataloaders=_loader(2))

    # validation (2 batches) ran after micro-batches 2, 4, 6, 8: twice in the middle of a window of 4, before
    # its optimizer step, and twice right after a step
    assert module.validated_at == [(2, 0), (2, 0), (4, 1), (4, 1), (6, 1), (6, 1), (8, 2), (8, 2)]
    assert torch.isfinite(trainer.callback_metrics["val_loss"])
    assert trainer.global_step == applied == 2
    _assert_params_equal(module, expected)  # the plain loop, which never validates
