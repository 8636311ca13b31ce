"""A linear fit by SGD, with accumulation, on a loader that resumes mid-epoch, checkpointed every 2 steps: whether
a resumed run ends with the uninterrupted run's weights. With dropout on its inputs, only where the resumed run
also draws the same masks."""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch.utils.data import DataLoader, TensorDataset

from pl_lowprec.callbacks import StepBoundaryCheckpoint
from pl_lowprec.data.resumable import resumable_loader

ACCUMULATE, EVERY = 2, 2


def _pairs(n: int, seed: int) -> TensorDataset:
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(x, x.sum(1, keepdim=True))


class Regression(pl.LightningModule):
    """20 samples in batches of 2: 10 batches, 5 steps an epoch accumulating 2; 4 validation samples."""

    def __init__(
        self,
        dropout: float = 0.0,
        plain_loader: bool = False,
        epoch_scheduler: bool = False,
        shuffled_validation: bool = False,
        step_scheduler: bool = False,
    ) -> None:
        super().__init__()
        self.step_scheduler = step_scheduler  # halve the learning rate at each optimizer step
        self.shuffled_validation = shuffled_validation  # a RandomSampler without generator: draws at each validation
        self.epoch_scheduler = epoch_scheduler  # halve the learning rate at each epoch's end
        self.plain_loader = plain_loader  # a shuffled DataLoader without state or generator: draws at each epoch
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(4, 1)
        self.dropout = torch.nn.Dropout(dropout) if dropout else torch.nn.Identity()

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(self.dropout(x)), y)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.layer(x), y))

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        if self.step_scheduler:
            halving = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": halving, "interval": "step"}}
        if not self.epoch_scheduler:
            return optimizer
        halving = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": halving, "interval": "epoch"}}

    def train_dataloader(self):
        if self.plain_loader:
            return DataLoader(_pairs(20, 1), batch_size=2, shuffle=True)
        return resumable_loader(_pairs(20, 1), 2, None, self.trainer)

    def val_dataloader(self):
        return DataLoader(_pairs(4, 2), batch_size=2, shuffle=self.shuffled_validation)


class Failure(Exception):
    pass


class FailAt(pl.Callback):
    """Raises in ``hook`` on the run's batch ``batch`` (accumulating 2: batch 4 opens step 3, batch 5 ends it), on
    the ranks ``ranks`` (every rank where ``None``)."""

    def __init__(self, hook: str, batch: int, ranks: set[int] | None = None) -> None:
        self.hook, self.batch, self.ranks, self.index, self.failing = hook, batch, ranks, -1, False

    def _fail_in(self, hook: str) -> None:
        if self.failing and hook == self.hook and self.index == self.batch:
            raise Failure(f"{hook} at batch {self.batch}")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.index = trainer.fit_loop.total_batch_idx
        self.failing = self.ranks is None or trainer.global_rank in self.ranks
        self._fail_in("on_train_batch_start")

    def on_before_backward(self, trainer, pl_module, loss):
        self._fail_in("on_before_backward")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self._fail_in("on_before_optimizer_step")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._fail_in("on_train_batch_end")  # before the checkpoint's own (Lightning calls checkpoints last)


class HalfAppliedSGD(torch.optim.Optimizer):
    """Plain SGD whose step, where ``fails()`` says so, raises ``raised`` after updating its first parameter only:
    the weight holds the new step, the bias the old one."""

    def __init__(self, params, lr, fails, raised):
        super().__init__(params, {"lr": lr})
        self.fails, self.raised = fails, raised

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:  # Lightning's plain precision: training_step and backward run in here first
            with torch.enable_grad():
                loss = closure()
        group = self.param_groups[0]
        for index, parameter in enumerate(group["params"]):
            if index == 1 and self.fails():
                raise self.raised("inside the optimizer's update")
            parameter.add_(parameter.grad, alpha=-group["lr"])
        return loss


class UpdateRaisesHalfway(Regression):
    """Its optimizer's step raises halfway through the update on the run's batch ``failing_batch``, on the ranks
    ``failing_ranks`` (every rank where ``None``)."""

    failing_batch: int | None = None
    failing_ranks: set[int] | None = None
    raised: type[BaseException] = Failure

    def configure_optimizers(self):
        def fails() -> bool:
            ranks = self.failing_ranks
            on_this_rank = ranks is None or self.trainer.global_rank in ranks
            return on_this_rank and self.trainer.fit_loop.total_batch_idx == self.failing_batch

        return HalfAppliedSGD(self.parameters(), 0.1, fails, self.raised)


def fit(
    directory,
    checkpoint_class=StepBoundaryCheckpoint,
    ckpt_path=None,
    strategy="auto",
    schedule=None,
    dropout=0.0,
    seed=123,
    validate_every=None,
    plain_loader=False,
    epoch_scheduler=False,
    shuffled_validation=False,
    callbacks=(),
    step_scheduler=False,
    module_class=Regression,
    **trainer_args,
) -> torch.Tensor:
    """Train to ``max_steps`` (or ``max_epochs``), the random generator from ``seed`` (after the weights' own),
    saving every 2 steps (or on ``schedule``'s arguments) and ``last.ckpt`` into ``directory``; validating every
    ``validate_every`` batches where given, with ``callbacks`` besides; ``module_class``: a ``Regression`` subclass.
    The final weights."""
    model = module_class(dropout, plain_loader, epoch_scheduler, shuffled_validation, step_scheduler)
    torch.manual_seed(seed)
    schedule = {"every_n_train_steps": EVERY, "save_top_k": -1} if schedule is None else schedule
    trainer = pl.Trainer(
        accelerator=trainer_args.pop("accelerator", "cpu"),
        strategy=strategy,
        accumulate_grad_batches=ACCUMULATE,
        callbacks=[*callbacks, checkpoint_class(dirpath=directory, save_last=True, **schedule)],
        val_check_interval=validate_every,
        limit_val_batches=1.0 if validate_every else 0,
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_args,
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    return model.layer.weight.detach().cpu().clone()
