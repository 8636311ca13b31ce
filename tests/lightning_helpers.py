"""Tiny LightningModules and recording callbacks shared by the tests."""

from __future__ import annotations

import copy
import tempfile
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F


class Classifier(pl.LightningModule):
    """Wraps any classifier ``nn.Module``; optional step-interval LR schedule and injected overflows."""

    def __init__(
        self,
        model: nn.Module,
        lr: float = 1e-2,
        scheduler: bool = False,
        overflow_at_steps: tuple[int, ...] = (),
        optimizer_kwargs: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.model = model
        self.lr = lr
        self.scheduler = scheduler
        self.overflow_at_steps = set(overflow_at_steps)
        self.optimizer_kwargs = optimizer_kwargs or {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def on_after_backward(self) -> None:
        # Poison one gradient before unscale_, as an fp16 overflow in backward would.
        if self.trainer.global_step in self.overflow_at_steps:
            next(self.parameters()).grad.fill_(float("inf"))

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr, **self.optimizer_kwargs)
        if not self.scheduler:
            return opt
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class TwoOptimizers(Classifier):
    """Manual optimization stepping two optimizers a batch (``global_step`` counts both); at the batches in
    ``overflow_at_batches`` the gradients of the parameters ``poisoned`` picks (all by default; ``slice(1, None)``:
    the second optimizer's only, as it holds all but the first) are made inf."""

    def __init__(
        self, model: nn.Module, overflow_at_batches: tuple[int, ...] = (), poisoned: slice = slice(None)
    ) -> None:
        super().__init__(model)
        self.automatic_optimization = False
        self.overflow_at_batches = set(overflow_at_batches)
        self.poisoned = poisoned

    def training_step(self, batch, batch_idx):
        x, y = batch
        self.manual_backward(F.cross_entropy(self(x), y))
        if batch_idx in self.overflow_at_batches:
            for p in list(self.parameters())[self.poisoned]:
                p.grad.fill_(float("inf"))
        for optimizer in self.optimizers():
            optimizer.step()
            optimizer.zero_grad()

    def configure_optimizers(self):
        first, *rest = self.parameters()
        return [torch.optim.SGD([first], lr=0.01), torch.optim.SGD(rest, lr=0.01)]


class StepRecorder(pl.Callback):
    """Records parameters, optimizer state and LR: entry k is the state after k optimizer steps of the fit (a
    resumed fit's entry 0: where it resumed)."""

    def __init__(self) -> None:
        self.params: list[dict[str, torch.Tensor]] = []
        self.optim_states: list[dict] = []
        self.lrs: list[float] = []
        self._recorded_step = -1

    def on_train_start(self, trainer, pl_module) -> None:
        self._record(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step > self._recorded_step:  # an optimizer step happened (not mid-window)
            self._record(trainer, pl_module)

    def _record(self, trainer, pl_module) -> None:
        self._recorded_step = trainer.global_step
        self.params.append({k: v.detach().clone() for k, v in pl_module.named_parameters()})
        self.optim_states.append(copy.deepcopy(trainer.optimizers[0].state_dict()["state"]))
        self.lrs.append(trainer.optimizers[0].param_groups[0]["lr"])


# The Trainers' folders, removed when the test process ends (they used to stay in /tmp, one per Trainer).
TRAINER_ROOTS = tempfile.TemporaryDirectory(prefix="pl_lowprec_tests_")


def quiet_trainer(**kwargs: Any) -> pl.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        # A fresh folder per Trainer: nothing (memory_summary.json, checkpoints) lands in the working directory.
        default_root_dir=tempfile.mkdtemp(prefix="trainer_", dir=TRAINER_ROOTS.name),
    )
    return pl.Trainer(**{**defaults, **kwargs})


HIDDEN_LORA = {"r": 2, "lora_alpha": 4, "target_modules": ["hidden"]}  # for a small module's nn.Linear `hidden`


def classification_loader() -> torch.utils.data.DataLoader:
    """8 seeded rows of 8 features with 2 classes, in 2 batches of 4 (2 steps an epoch)."""
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(8, 8, generator=generator), torch.randint(0, 2, (8,), generator=generator)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


def mlp_batches(batches: int) -> torch.utils.data.DataLoader:
    """``batches`` batches of 8 rows of ``make_classification_data``, the input of ``make_mlp``."""
    # Imported here: the scripts in tests/_scripts import this module with tests/ alone on sys.path (no examples/).
    from plain_amp_loop import make_classification_data

    return torch.utils.data.DataLoader(make_classification_data(n=batches * 8), batch_size=8)
