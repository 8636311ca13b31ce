"""Trainer + AMPPrecision gives the parameters of the plain loop in examples/plain_amp_loop.py."""

import copy

import pytest
import torch
from lightning_helpers import Classifier, quiet_trainer
from plain_amp_loop import make_classification_data, make_mlp, train_plain_loop

from pl_lowprec import AMPPrecision

STEPS, ACCUMULATE, BATCH = 20, 4, 8


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
@pytest.mark.parametrize("clip", [1.0, 0.05])
def test_trainer_matches_plain_loop(precision, clip):
    data = make_classification_data(n=STEPS * ACCUMULATE * BATCH)
    loader = torch.utils.data.DataLoader(data, batch_size=BATCH, shuffle=False)
    reference = make_mlp()
    model = copy.deepcopy(reference)

    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    train_plain_loop(reference, loader, opt, precision=precision, accumulate=ACCUMULATE, clip=clip)

    plugin = AMPPrecision(precision)
    trainer = quiet_trainer(
        plugins=[plugin],
        max_epochs=1,
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=clip,
        gradient_clip_algorithm="norm",
    )
    trainer.fit(Classifier(model, lr=1e-2), loader)

    assert trainer.global_step == STEPS
    assert trainer.precision == precision
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert not torch.equal(ours, make_mlp().state_dict()[name]), f"{name} never trained"
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    if precision == "16-mixed":
        assert plugin.loss_scale_state().scale == 2.0**16  # no overflow in 20 steps, no growth before 2000


@pytest.mark.parametrize("precision", ["16-mixed", "bf16-mixed"])
def test_an_epochs_short_last_window_matches_the_plain_loop(precision):
    """10 batches an epoch in windows of 3: the last window of each epoch is one batch, stepped at the epoch's end
    with its loss still divided by 3 (Lightning's rule, the example loop's too), over 2 epochs and one scaler."""
    accumulate, epochs = 3, 2
    loader = torch.utils.data.DataLoader(make_classification_data(n=10 * BATCH), batch_size=BATCH, shuffle=False)
    reference = make_mlp()
    model = copy.deepcopy(reference)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "16-mixed")
    for _ in range(epochs):
        train_plain_loop(reference, loader, opt, precision=precision, accumulate=accumulate, clip=0.5, scaler=scaler)

    trainer = quiet_trainer(
        plugins=[AMPPrecision(precision)], max_epochs=epochs, accumulate_grad_batches=accumulate, gradient_clip_val=0.5
    )
    trainer.fit(Classifier(model, lr=1e-2), loader)

    assert trainer.global_step == epochs * 4  # 3 + 3 + 3 + 1 batches an epoch
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
