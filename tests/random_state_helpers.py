"""A linear fit with dropout on its inputs, trained with accumulation on a loader that resumes mid-epoch: its
weights after a resumed run equal the uninterrupted run's only where the resumed run draws the same masks."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from pl_lowprec.callbacks import StepBoundaryCheckpoint
from pl_lowprec.data.resumable import resumable_loader


def _pairs(n: int, seed: int) -> TensorDataset:
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(x, x.sum(1, keepdim=True))


class DropoutRegression(pl.LightningModule):
    """20 samples in batches of 2: 10 batches, 5 steps an epoch accumulating 2; 4 validation samples."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)
        self.dropout = torch.nn.Dropout(0.5)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(self.dropout(x)), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        return resumable_loader(_pairs(20, 1), 2, None, self.trainer)

    def val_dataloader(self):
        return DataLoader(_pairs(4, 2), batch_size=2)


def fit(directory, strategy="auto", ckpt_path=None, validate_every=None, seed=123, **trainer_args) -> torch.Tensor:
    """Train from ``seed`` (the masks' generator), saving every 2 steps and the final step; the final weights."""
    model = DropoutRegression()
    torch.manual_seed(seed)  # after the model's own seed for its weights
    trainer = pl.Trainer(
        accelerator="cpu",
        strategy=strategy,
        accumulate_grad_batches=2,
        callbacks=[StepBoundaryCheckpoint(dirpath=directory, every_n_train_steps=2, save_last=True)],
        val_check_interval=validate_every,
        limit_val_batches=1.0 if validate_every else 0,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_args,
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    return model.layer.weight.detach().clone()
