"""A tiny Llama trained with the token-mean loss, sequences with very different target-token counts, and the
one-big-batch reference gradient step."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from loading_helpers import llama_config

from pl_lowprec.models.token_loss import IGNORE_INDEX, TokenMeanLoss, token_loss_sum

LR = 1.0


class TokenMeanLlama(pl.LightningModule):
    def __init__(self, token_mean: bool = True) -> None:
        super().__init__()
        from transformers import LlamaForCausalLM

        torch.manual_seed(0)
        self.model = LlamaForCausalLM(llama_config(hidden_size=32, layers=1))
        self.token_mean = TokenMeanLoss() if token_mean else None
        self.step_losses: list[float] = []  # what normalize_gradients returns, one per optimizer step

    def training_step(self, batch, batch_idx):
        logits = self.model(input_ids=batch["input_ids"], use_cache=False).logits
        loss_sum, tokens = token_loss_sum(logits, batch["labels"])
        if self.token_mean is None:  # Lightning's own: a mean per micro-batch, averaged over the window
            return loss_sum / tokens
        return self.token_mean.scaled(self.trainer, loss_sum, tokens)

    def on_before_optimizer_step(self, optimizer) -> None:
        if self.token_mean is not None:
            self.step_losses.append(float(self.token_mean.normalize_gradients(self.trainer, self.parameters())))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR)


def uneven_rows(n: int = 8, seq_len: int = 17, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """Rows whose number of target tokens ranges from 1 to seq_len - 1 (prompt masked with -100)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        ids = torch.randint(0, 256, (seq_len,), generator=g)
        labels = ids.clone()
        masked = [seq_len - 2, 0, seq_len - 4, 3, 10, 1, seq_len - 3, 6][i % 8]
        labels[: masked + 1] = IGNORE_INDEX
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def big_batch_loss(module: TokenMeanLlama, rows: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    """The mean loss over every target token of ``rows``, in one batch."""
    ids = torch.stack([r["input_ids"] for r in rows])
    labels = torch.stack([r["labels"] for r in rows])
    loss_sum, tokens = token_loss_sum(module.model(input_ids=ids, use_cache=False).logits, labels)
    return loss_sum / tokens


def big_batch_step(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Parameters after one SGD step on the mean loss over every target token of ``rows``, in one batch."""
    module = TokenMeanLlama(token_mean=False)
    big_batch_loss(module, rows).backward()
    with torch.no_grad():
        for p in module.parameters():
            p -= LR * p.grad
    return {k: v.detach().clone() for k, v in module.state_dict().items()}
