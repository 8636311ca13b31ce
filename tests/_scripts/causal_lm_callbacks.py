"""Callbacks that ``causal_lm_cli.py`` adds to ``pl-lowprec fit`` by class_path (``tests/_scripts`` on PYTHONPATH).

- ``RecordLoss``: the loss of every micro-batch over all ranks' target tokens (what one process computes on the
  whole global batch), the gradients of the first optimizer step and ``val/loss`` at each validation, written
  by rank 0 to ``out`` after every micro-batch (a killed run keeps what it did); at the end, the trained
  adapters, gathered whole.
- ``KillAt``: SIGKILL on every rank once ``global_step`` reaches ``step`` (after a checkpoint, before the next).
"""

import os
import signal

import lightning.pytorch as pl
import torch

from pl_lowprec.adapters import trainable_state_dict
from pl_lowprec.distributed.mesh import full_tensor
from pl_lowprec.models.token_loss import IGNORE_INDEX


class RecordLoss(pl.Callback):
    def __init__(self, out: str) -> None:
        self.out = out
        self.record: dict = {"losses": [], "val_losses": [], "grads": None, "adapters": None}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        # this rank's mean per target token, as CausalLM logs it, weighted by its tokens and summed over ranks
        tokens = (batch["labels"][:, 1:] != IGNORE_INDEX).sum().to(torch.float64)
        local = trainer.callback_metrics["train/loss"].to(torch.float64)
        total = trainer.strategy.reduce(local * tokens, reduce_op="sum")
        count = trainer.strategy.reduce(tokens, reduce_op="sum")
        self.record["losses"].append((trainer.global_step, float(total / count)))
        if trainer.global_step == 1 and self.record["grads"] is None:  # the step's gradients, as the optimizer saw them
            params = pl_module.named_parameters()
            self.record["grads"] = {n: full_tensor(p.grad).cpu().clone() for n, p in params if p.grad is not None}
        self._save(trainer)

    def on_validation_end(self, trainer, pl_module) -> None:
        if "val/loss" in trainer.callback_metrics and not trainer.sanity_checking:
            self.record["val_losses"].append((trainer.global_step, float(trainer.callback_metrics["val/loss"])))

    def on_train_end(self, trainer, pl_module) -> None:
        adapters = trainable_state_dict(pl_module)
        self.record["adapters"] = {k: full_tensor(v.detach()).cpu().clone() for k, v in adapters.items()}
        self._save(trainer)

    def _save(self, trainer) -> None:
        if trainer.global_rank == 0:
            torch.save(self.record, self.out)


class KillAt(pl.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGKILL)
