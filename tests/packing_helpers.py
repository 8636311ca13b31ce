"""A user's own LightningModule around a Hugging Face causal LM, calling it the ways users do, for the packing
guard's tests; and a callback that counts the batches and the model's forward calls."""

from __future__ import annotations

import json
from pathlib import Path

import lightning.pytorch as pl
import torch

from pl_lowprec.models import forward_batch

# How a step calls its model on a packed batch. "old advice" is what the package used to recommend (position_ids,
# no attention_mask) without use_cache=False; the model's config has use_cache=True, as most hub models.
CALLS = ("old advice", "use_cache=False", "forward_batch", "attention_mask", "no position_ids")


def call_model(model, batch: dict[str, torch.Tensor], call: str):
    """``model``'s output on ``batch``, called as ``call`` says."""
    if call == "forward_batch":
        return forward_batch(model, batch, labels=batch["labels"])
    ids, positions = batch["input_ids"], batch.get("position_ids")
    kwargs = {
        "old advice": {"position_ids": positions},
        "use_cache=False": {"position_ids": positions, "use_cache": False},
        "attention_mask": {"position_ids": positions, "attention_mask": torch.ones_like(ids), "use_cache": False},
        "no position_ids": {"use_cache": False},
    }[call]
    return model(input_ids=ids, labels=batch["labels"], **kwargs)


class HFUser(pl.LightningModule):
    """A Hugging Face ``LlamaForCausalLM`` (SDPA, config ``use_cache=True``) trained by the user's own steps."""

    accepts_packed_batches = True

    def __init__(self, pretrained: str, train_call: str = "forward_batch", val_call: str | None = None) -> None:
        super().__init__()
        from transformers import LlamaForCausalLM

        self.model = LlamaForCausalLM.from_pretrained(pretrained, attn_implementation="sdpa")
        self.model.train()
        assert self.model.config.use_cache  # as most hub models
        self.train_call, self.val_call = train_call, val_call or train_call
        self.steps_done = 0  # training steps that got past the model call

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = call_model(self.model, batch, self.train_call).loss
        self.steps_done += 1
        self.log("train/loss", loss)
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.log("val/loss", call_model(self.model, batch, self.val_call).loss)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)


class ForwardCounter(pl.Callback):
    """Counts the batches the loops ran and the calls of every ``LlamaModel`` (once per step, or per check run)."""

    def __init__(self) -> None:
        self.train_batches = self.val_batches = self.forwards = 0

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from transformers import LlamaModel

        for module in pl_module.modules():
            if isinstance(module, LlamaModel):
                module.register_forward_pre_hook(self._count)

    def _count(self, *_) -> None:
        self.forwards += 1

    def on_train_batch_end(self, *_) -> None:
        self.train_batches += 1

    def on_validation_batch_end(self, *_) -> None:
        self.val_batches += 1


def prompt_completion_file(path: Path, n: int = 12) -> Path:
    """``n`` prompt/completion records of varied lengths (several share a packed row of 64 tokens)."""
    rows = [{"prompt": f"def f{i}(x):\n    return", "completion": " x" + " + 1" * (i % 7)} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def quiet_trainer(**kwargs) -> pl.Trainer:
    defaults = {
        "accelerator": "cpu",
        "precision": "32-true",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
    }
    return pl.Trainer(**{**defaults, **kwargs})
