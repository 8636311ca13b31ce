"""A plain-PyTorch causal language model: proof that any ``LightningModule`` works, no Hugging Face needed."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F

from pl_lowprec._checks import check_at_least, check_model_sizes, check_positive
from pl_lowprec.demo.stdlib_text import VOCAB_SIZE


class Block(nn.Module):
    """Pre-norm Transformer block; the unit that activation checkpointing wraps."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm1(x)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device, dtype=torch.bool)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyGPT(pl.LightningModule):
    """Byte-level GPT. Batches are ``{"input_ids": [B, T]}``; the loss is next-byte cross-entropy.

    Args:
        dim: Model width.
        layers: Number of ``Block``s.
        heads: Attention heads.
        max_len: Longest sequence (learned positions).
        lr: AdamW learning rate.
        warmup_steps: Linear warm-up of the LR, stepped per optimizer step.
    """

    def __init__(
        self,
        dim: int = 64,
        layers: int = 2,
        heads: int = 4,
        max_len: int = 256,
        lr: float = 3e-3,
        warmup_steps: int = 10,
    ) -> None:
        super().__init__()
        check_model_sizes("TinyGPT", ("dim", dim), ("heads", heads), layers=layers, max_len=max_len)
        check_positive("TinyGPT", lr=lr)
        check_at_least("TinyGPT", 0, warmup_steps=warmup_steps)
        self.save_hyperparameters()
        self.lr = lr
        self.warmup_steps = warmup_steps
        self.embed = nn.Embedding(VOCAB_SIZE, dim)
        self.pos = nn.Parameter(torch.zeros(max_len, dim))
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB_SIZE)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) + self.pos[: input_ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def _loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        ids = batch["input_ids"]
        logits = self(ids[:, :-1])
        return F.cross_entropy(logits.float().reshape(-1, VOCAB_SIZE), ids[:, 1:].reshape(-1))

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss = self._loss(batch)
        self.log("val/loss", loss, prog_bar=True)
        self.log("val/perplexity", loss.exp())

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("test/loss", self._loss(batch))

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """The most likely next byte after each prefix."""
        return self(batch["input_ids"]).argmax(-1)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        warmup = max(1, self.warmup_steps)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
