"""Any LightningModule works: a plain-PyTorch Transformer classifier gets fp16 AMP with loss scaling,
activation checkpointing, accumulation and the monitors from pl_lowprec, with no change to the module.

The task is generated locally: is the number of "1" tokens in a random sequence even or odd? Parity needs
attention over the whole sequence, so the model must really learn.

Run: python examples/plain_transformer_classifier.py [--fast]
"""

from __future__ import annotations

import argparse
import warnings

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F

from pl_lowprec import AMPPrecision, LossScaleMonitor, LowPrecisionStrategy, MemoryTracker

warnings.filterwarnings("ignore", message=r".*LeafSpec.*", category=FutureWarning)


class ParityClassifier(pl.LightningModule):
    """Embedding, a stack of ``nn.TransformerEncoderLayer``, mean pooling, a linear head."""

    def __init__(self, vocab: int = 4, dim: int = 64, layers: int = 4, lr: float = 1e-3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=4 * dim, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, 2)
        self.lr = lr

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(tokens)).mean(1))

    def training_step(self, batch, batch_idx):
        tokens, label = batch
        loss = F.cross_entropy(self(tokens), label)
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        tokens, label = batch
        self.log("val/accuracy", (self(tokens).argmax(-1) == label).float().mean(), prog_bar=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)


def parity_data(n: int, length: int = 16, seed: int = 0) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 4, (n, length), generator=g)
    return torch.utils.data.TensorDataset(tokens, ((tokens == 1).sum(1) % 2).long())


def main(fast: bool = False) -> pl.Trainer:
    steps = 4 if fast else 300
    train = torch.utils.data.DataLoader(parity_data(4096), batch_size=32, shuffle=True)
    val = torch.utils.data.DataLoader(parity_data(512, seed=1), batch_size=128)
    trainer = pl.Trainer(
        accelerator="auto",
        devices=1,
        max_steps=steps,
        accumulate_grad_batches=2,
        gradient_clip_val=1.0,
        val_check_interval=min(steps * 2, 100),
        limit_val_batches=1 if fast else 4,
        plugins=[AMPPrecision("16-mixed", init_scale=1024.0)],
        strategy=LowPrecisionStrategy(activation_checkpointing=[nn.TransformerEncoderLayer]),
        callbacks=[LossScaleMonitor(), MemoryTracker()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=not fast,
    )
    trainer.fit(ParityClassifier(), train, val)
    return trainer


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fast", action="store_true", help="a few steps only (used by the tests)")
    main(parser.parse_args().fast)
