"""The mean loss over every target token of an accumulation window and of every rank.

Lightning divides each micro-batch's loss by ``accumulate_grad_batches`` and DDP averages gradients over
ranks, so a window's gradient is a mean of per-micro-batch means: a micro-batch with 10 target tokens weighs
as much as one with 1000 (Lightning #20350). Hugging Face fixes it with ``num_items_in_batch``, prefetching
the window's batches to count their tokens first. Here no prefetch is needed, because the gradient is linear
in the loss: each micro-batch returns its *sum* of token losses divided by ``c`` (a window-wide constant: the
first micro-batch's target tokens, averaged over ranks), so that after Lightning's ``/k`` its backward carries the
magnitude of the plain loop's ``mean / k``, and fp16 loss scaling overflows where the plain loop's and Hugging Face's
do; before the optimizer step (after unscaling, before clipping) the gradients are multiplied by
``k * world_size * c / N``, with ``N`` the window's target tokens summed over ranks (undoing Lightning's ``/k``,
DDP's mean over ranks and ``c``): one scalar all-reduce per window. The result equals the gradient of one big
batch's token-mean loss. The same all-reduce carries the window's summed loss, so the loss that was optimized (the
window's mean per target token over every rank: what one process computes on the whole global batch) comes at no
extra cost.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.nn import functional as F

IGNORE_INDEX = -100


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy and the number of target tokens (Hugging Face's shift: position t
    predicts ``labels[t + 1]``; ``-100`` marks no loss)."""
    shifted = labels[:, 1:]
    loss = F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.size(-1)).float(),
        shifted.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    return loss, (shifted != IGNORE_INDEX).sum()


class TokenMeanLoss:
    """Makes a window's gradient the gradient of its mean loss per target token, across accumulation and ranks.

    In a ``LightningModule`` (automatic optimization)::

        def training_step(self, batch, batch_idx):
            loss_sum, tokens = token_loss_sum(self(batch["input_ids"]), batch["labels"])
            return self.token_mean.scaled(self.trainer, loss_sum, tokens)

        def on_before_optimizer_step(self, optimizer):
            step_loss = self.token_mean.normalize_gradients(self.trainer, self.parameters())
            self.log("train/step_loss", step_loss)
    """

    def __init__(self) -> None:
        self.scale: torch.Tensor | None = None  # c, shared by every micro-batch and rank of the window
        self.tokens: torch.Tensor | None = None  # this rank's target tokens in the window so far
        self.loss: torch.Tensor | None = None  # this rank's summed token losses in the window so far

    def scaled(self, trainer: pl.Trainer, loss_sum: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """What ``training_step`` returns for this micro-batch."""
        if not trainer.lightning_module.automatic_optimization:
            raise ValueError(
                "TokenMeanLoss works with automatic optimization; with manual optimization, divide by"
                " the window's token count yourself."
            )
        tokens = tokens.detach().to(torch.float64)
        if self.scale is None:  # first micro-batch of the window: a common magnitude for all of it
            self.scale = trainer.strategy.reduce(tokens.clamp(min=1.0), reduce_op="mean").detach()
            self.tokens = torch.zeros_like(tokens)
            self.loss = torch.zeros_like(tokens)
        self.tokens = self.tokens + tokens
        self.loss = self.loss + loss_sum.detach().to(torch.float64)
        return loss_sum / self.scale.to(loss_sum.dtype)

    def normalize_gradients(self, trainer: pl.Trainer, parameters) -> torch.Tensor | None:
        """Turn the window's accumulated gradients into those of its token-mean loss; call once per step. Returns
        that loss (float32, the same on every rank), or ``None`` where no micro-batch came since the last call."""
        if self.scale is None:
            return None
        loss, tokens = trainer.strategy.reduce(torch.stack([self.loss, self.tokens]), reduce_op="sum")
        window = trainer.accumulate_grad_batches * trainer.world_size
        factor = (window * self.scale / tokens.clamp(min=1.0)).item()
        self.scale = self.tokens = self.loss = None
        grads = [param.grad for param in parameters if param.grad is not None]
        if grads:  # one call for every gradient, as clip_grad_norm_ scales them: not a kernel launch each
            torch._foreach_mul_(grads, factor)
        return (loss / tokens.clamp(min=1.0)).float()
