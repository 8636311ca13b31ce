"""A tiny Hugging Face Llama built from a ``LlamaConfig`` (nothing downloaded) as a causal-LM LightningModule.

The weights are initialised from ``init_seed``, standing in for a pretrained checkpoint: every run with the same
settings starts from the same base, which is what resuming an adapter-only checkpoint needs.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from lightning_utilities.core.imports import RequirementCache
from torchmetrics.text import Perplexity

from pl_lowprec._checks import check_at_least, check_model_sizes, check_positive
from pl_lowprec.demo.stdlib_text import VOCAB_SIZE

_TRANSFORMERS = RequirementCache("transformers>=4.45")


class TinyLlama(pl.LightningModule):
    """Byte-level ``LlamaForCausalLM``; batches are ``{"input_ids": [B, T]}``; logs ``val/perplexity``.

    Args:
        hidden_size: Model width (128 keeps 4-bit weights at about 0.52 bytes per parameter).
        intermediate_size: MLP width.
        num_layers: Decoder layers (``LlamaDecoderLayer``, the block to checkpoint).
        num_heads: Attention heads.
        max_len: Longest sequence.
        lr: AdamW learning rate (for the trainable parameters only).
        warmup_steps: Linear LR warm-up, stepped per optimizer step.
        init_seed: Seed of the base weights.
    """

    def __init__(
        self,
        hidden_size: int = 128,
        intermediate_size: int = 352,
        num_layers: int = 2,
        num_heads: int = 4,
        max_len: int = 256,
        lr: float = 3e-3,
        warmup_steps: int = 10,
        init_seed: int = 0,
    ) -> None:
        super().__init__()
        if not _TRANSFORMERS:
            raise ModuleNotFoundError(
                f'TinyLlama needs transformers: {_TRANSFORMERS.message}. Install: pip install "pl_lowprec[hf]"'
            )
        from transformers import LlamaConfig, LlamaForCausalLM

        check_model_sizes(
            "TinyLlama",
            ("hidden_size", hidden_size),
            ("num_heads", num_heads),
            intermediate_size=intermediate_size,
            num_layers=num_layers,
            max_len=max_len,
        )
        check_positive("TinyLlama", lr=lr)
        check_at_least("TinyLlama", 0, warmup_steps=warmup_steps)
        self.save_hyperparameters()
        config = LlamaConfig(
            vocab_size=VOCAB_SIZE,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_heads,
            max_position_embeddings=max_len,
            tie_word_embeddings=False,
        )
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(init_seed)
            self.model = LlamaForCausalLM(config)
        self.lr = lr
        self.warmup_steps = warmup_steps
        self.val_perplexity = Perplexity()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids = batch["input_ids"]
        loss = self.model(input_ids=ids, labels=ids, use_cache=False).loss
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def on_fit_start(self) -> None:
        # A validate() before fit leaves the metric's state as inference-mode tensors, which fit's validation
        # (run under no_grad) may not update in place. Fresh state outside inference mode avoids that.
        self.val_perplexity.reset()

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        ids = batch["input_ids"]
        logits = self(ids)
        self.val_perplexity.update(logits[:, :-1].float(), ids[:, 1:])
        self.log("val/perplexity", self.val_perplexity, prog_bar=True)

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        ids = batch["input_ids"]
        self.log("test/loss", self.model(input_ids=ids, labels=ids, use_cache=False).loss)

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        """The most likely next byte after each prefix."""
        return self(batch["input_ids"]).argmax(-1)

    def configure_optimizers(self):
        params = [p for p in self.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=self.lr)
        warmup = max(1, self.warmup_steps)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
