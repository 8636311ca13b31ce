"""The plain PyTorch loop that ``AMPPrecision`` reproduces, step for step.

It is the loop of PyTorch's own AMP examples (https://pytorch.org/docs/stable/notes/amp_examples.html,
"Gradient accumulation" combined with "Gradient clipping"), written for any device:

    with autocast: loss = loss_fn(model(x), y) / accumulate
    scaler.scale(loss).backward()
    every `accumulate` micro-batches: unscale_ -> clip_grad_norm_ -> scaler.step -> scaler.update -> zero_grad

An epoch whose batch count is not a multiple of ``accumulate`` ends with a shorter window, stepped at its last
batch with its losses still divided by ``accumulate``, as Lightning's ``accumulate_grad_batches`` does; one
GradScaler serves every epoch, as the Trainer keeps one.

``Trainer(plugins=[AMPPrecision(...)], accumulate_grad_batches=..., gradient_clip_val=...)`` gives the same
parameters; ``tests/plugins/test_amp_equivalence.py`` checks it.

Run: python examples/plain_amp_loop.py [--fast]
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable

import torch
from torch import nn
from torch.nn import functional as F


def train_plain_loop(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    optimizer: torch.optim.Optimizer,
    precision: str = "16-mixed",
    accumulate: int = 4,
    clip: float | None = 1.0,
    device: str = "cpu",
    scaler: torch.amp.GradScaler | None = None,
) -> list[float]:
    """Train one epoch in place; return the loss of every micro-batch (unscaled, undivided). Pass one ``scaler``
    to every epoch to keep its scale, as the Trainer does."""
    dtype = torch.float16 if precision == "16-mixed" else torch.bfloat16
    scaler = scaler or torch.amp.GradScaler(device, enabled=dtype == torch.float16)
    losses = []
    model.train()
    for i, (x, y) in enumerate(batches):
        with torch.autocast(device, dtype=dtype):
            loss = F.cross_entropy(model(x.to(device)), y.to(device))
        losses.append(loss.item())
        scaler.scale(loss / accumulate).backward()
        if (i + 1) % accumulate == 0:
            _step(model, optimizer, scaler, clip)
    if len(losses) % accumulate:  # the epoch's short last window
        _step(model, optimizer, scaler, clip)
    return losses


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, clip: float | None) -> None:
    scaler.unscale_(optimizer)
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


def make_classification_data(n: int = 256, features: int = 32, classes: int = 4, seed: int = 0):
    """A learnable synthetic task: the class is the argmax of a fixed random projection."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=g)
    y = (x @ torch.randn(features, classes, generator=g)).argmax(-1)
    return torch.utils.data.TensorDataset(x, y)


def make_mlp(features: int = 32, classes: int = 4, hidden: int = 64, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(features, hidden), nn.LayerNorm(hidden), nn.GELU(), nn.Linear(hidden, classes))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="The plain AMP loop with accumulation and clipping.")
    parser.add_argument("--fast", action="store_true", help="one short epoch (used by the tests)")
    fast = parser.parse_args().fast
    model = make_mlp()
    loader = torch.utils.data.DataLoader(make_classification_data(n=64 if fast else 256), batch_size=8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu")
    for epoch in range(1 if fast else 3):
        losses = train_plain_loop(model, loader, opt, scaler=scaler)
        print(f"epoch {epoch}: mean loss {sum(losses) / len(losses):.4f}")
