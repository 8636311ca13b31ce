"""``CausalLM``: any Hugging Face causal LM as a LightningModule, built on the meta device and loaded by the
strategy's streaming loader (quantized as it loads under ``LowPrecisionStrategy(quantization=...)``).

Training uses the token-mean loss across accumulation and ranks (``pl_lowprec.models.token_loss``) and, with
``loss_chunk_size``, never holds the whole batch's fp32 logits (``pl_lowprec.models.chunked_loss``). Its loss has
two of the strategy's ``memory_saving`` paths (``grouped_cross_entropy``, and ``chunked_loss`` where
``loss_chunk_size="auto"``), switched through ``configure_memory_saving``.
Validation logs ``val/loss`` (mean per target token) and ``val/perplexity``, through torchmetrics.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torchmetrics import MeanMetric

from pl_lowprec._checks import check_at_least, check_positive
from pl_lowprec._hparams import paths_as_strings
from pl_lowprec.distributed.process_group_exit import destroy_process_group_at_exit
from pl_lowprec.distributed.shard import shard_pretrained_blocks
from pl_lowprec.loading import PretrainedWeights, empty_weights, load_pretrained
from pl_lowprec.loading.empty import storage_to_fill
from pl_lowprec.loading.generation_config import load_generation_config
from pl_lowprec.loading.hub import resolve_pretrained
from pl_lowprec.models.causal_config import check_causal_lm_config
from pl_lowprec.models.chunked_loss import causal_lm_loss_sum, chunk_loss, compiled_chunk_loss_standin
from pl_lowprec.models.forward_batch import forward_batch
from pl_lowprec.models.liger_loss import LossKernel, check_head, check_loss_kernel, choose_loss_kernel, liger_loss_sum
from pl_lowprec.models.standalone_load import check_loads_without_strategy
from pl_lowprec.models.token_loss import TokenMeanLoss
from pl_lowprec.models.tokenizer_check import check_tokenizer
from pl_lowprec.transforms.dtypes import to_dtype
from pl_lowprec.transforms.memory_saving import AUTO

PREFIX = "model."  # the Hugging Face model is held as self.model: tried first (a base model's keys need more)
AUTO_LOSS_CHUNK = 256  # loss_chunk_size="auto" with the chunked_loss path on


class CausalLM(pl.LightningModule):
    """Fine-tune a Hugging Face causal LM; batches are ``{"input_ids", "attention_mask", "labels"}``, or packed
    ``{"input_ids", "position_ids", "labels"}`` (``TextDataModule(packing=True)``): with ``position_ids``, no
    mask and no cache (``forward_batch``), transformers cuts attention where the positions restart.

    Args:
        pretrained: A local model directory (``save_pretrained``), or a hub id where the network is available.
            A ``config.json`` file (or a directory holding only it) builds the model's shapes, which is all
            ``estimate_memory`` needs; training needs the weights.
        lr: Peak AdamW learning rate (trainable parameters only).
        weight_decay: AdamW weight decay.
        warmup_steps: Linear warm-up from 0, in optimizer steps.
        min_lr_ratio: Cosine decay ends at ``lr * min_lr_ratio`` at the Trainer's last step.
        loss_chunk_size: Positions per chunk of the loss (``None``: all at once); 256 holds 8x less of
            the fp32 logits than a 2048-token sequence, for one more output-head matmul per chunk. ``"auto"``: the
            strategy's ``memory_saving`` decides (its ``chunked_loss`` path: 256, else all at once; 256 under a
            plain Lightning strategy); ``fit`` under ``memory_saving: auto`` chooses it for the device.
        dtype: dtype of the parameters that stay unquantized (``"bfloat16"``...); ``None`` follows the
            default dtype (the precision plugin's under ``-true`` precisions).
        loss_kernel: ``"torch"`` (default): the output head and PyTorch's cross-entropy (in chunks of
            ``loss_chunk_size``); ``"liger"``: Liger-Kernel's fused linear cross-entropy, which never holds the
            logits (CUDA only; ``pip install "pl_lowprec[liger]"``); ``"auto"``: Liger where it runs, else
            ``"torch"``, said in one line.
    """

    # position_ids reach the model with no mask and no cache (forward_batch). TextDataModule(packing=True) checks
    # this declaration, and checks the samples stay apart unless forward, loss_sum and the steps are these ones.
    accepts_packed_batches = True

    def __init__(
        self,
        pretrained: str,
        lr: float = 2e-4,
        weight_decay: float = 0.0,
        warmup_steps: int = 10,
        min_lr_ratio: float = 0.1,
        loss_chunk_size: int | Literal["auto"] | None = None,
        dtype: str | None = None,
        loss_kernel: LossKernel = "torch",
    ) -> None:
        super().__init__()
        check_loss_kernel(loss_kernel)
        if loss_chunk_size not in (None, AUTO) and (not isinstance(loss_chunk_size, int) or loss_chunk_size < 1):
            raise ValueError(
                f"CausalLM(loss_chunk_size={loss_chunk_size}) must be a positive number of positions, 'auto' (the"
                " strategy's memory_saving decides) or None (all positions at once)."
            )
        if not 0 <= min_lr_ratio <= 1:
            raise ValueError(f"CausalLM(min_lr_ratio={min_lr_ratio}) must be between 0 and 1.")
        check_positive("CausalLM", "LoRA usually trains at 1e-4 to 3e-3.", lr=lr)
        check_at_least("CausalLM", 0, warmup_steps=warmup_steps)
        if not math.isfinite(weight_decay) or weight_decay < 0:
            raise ValueError(f"CausalLM(weight_decay={weight_decay}) must be a finite number >= 0 (0: none).")
        from transformers import AutoConfig

        self.save_hyperparameters()
        # LightningCLI saves only a subclass's own arguments (given_hyperparameters_context): the ones this class
        # reads back (configure_optimizers, the loss settings) are added with the values it was given
        received = {"pretrained": pretrained, "lr": lr, "weight_decay": weight_decay, "warmup_steps": warmup_steps}
        received |= {"min_lr_ratio": min_lr_ratio, "loss_chunk_size": loss_chunk_size, "dtype": dtype}
        for name, value in (received | {"loss_kernel": loss_kernel}).items():
            self.hparams.setdefault(name, value)
        paths_as_strings(self.hparams)
        config_file = Path(pretrained).expanduser()
        if config_file.suffix == ".json" and config_file.is_file():  # shapes only, for estimate_memory
            self.directory = config_file.parent
        else:
            self.directory, config_file = resolve_pretrained(pretrained), None
        self.config = AutoConfig.from_pretrained(str(config_file or self.directory), local_files_only=True)
        check_causal_lm_config(self.config, pretrained)  # a classifier's: refused before anything is built
        self._pretrained_weights: PretrainedWeights | None = None
        self._checked_tokenizer: Any = None
        self.dtype_override = to_dtype(dtype)
        self.model: Any = None
        self.token_mean = TokenMeanLoss()
        self.val_nll = MeanMetric()
        self.loss_fn = chunk_loss
        self.loss_chunk = AUTO_LOSS_CHUNK if loss_chunk_size == AUTO else loss_chunk_size
        self.grouped_cross_entropy = True
        self.loss_kernel_in_use: Literal["torch", "liger"] | None = None  # set on the device in on_fit_start

    @property
    def pretrained_weights(self) -> PretrainedWeights:
        """The weights the strategy streams in, checked when first needed: a directory with only ``config.json``
        builds the model (``estimate_memory`` needs nothing more), training needs the weights."""
        if self._pretrained_weights is None:  # its own error names the directory, what it lacks and the fix
            self._pretrained_weights = PretrainedWeights(self.directory, expected_prefix=PREFIX)
        return self._pretrained_weights

    def setup(self, stage: str) -> None:
        """Before any weight loads (``configure_model`` runs after): the data's tokenizer fits this model."""
        datamodule = getattr(self.trainer, "datamodule", None)
        tokenizer = getattr(datamodule, "tokenizer", None)
        if tokenizer is not None and tokenizer is not self._checked_tokenizer:
            self.check_data_tokenizer(tokenizer, getattr(datamodule, "tokenizer_dir", None))

    def check_data_tokenizer(self, tokenizer: Any, source: str | Path | None) -> None:
        """``ValueError`` when the data's tokenizer does not fit this model (``tokenizer_check``). A data module
        calls it as soon as it has its tokenizer, before reading records (``TextDataModule``): a refusal of the
        records (``seq_len`` truncates them) would otherwise come first and hide this cause."""
        check_tokenizer(tokenizer, str(source) if source else None, self.config, self.directory)
        self._checked_tokenizer = tokenizer

    def configure_model(self) -> None:
        """Build the model with its parameters on the meta device; the strategy fills them from ``pretrained``.

        Under a plain Lightning strategy the module fills them here, even where ``ckpt_path=`` restores a checkpoint
        holding every weight next: Lightning runs this hook before the restore, with no sign of it
        (``trainer.ckpt_path`` is set after), and runs no hook between them when none comes, before its ``setup``
        converts the module (precision plugins) and wraps or broadcasts it. ``LowPrecisionStrategy()`` restores
        before it loads and then reads no pretrained file (``transforms/checkpoint_fills.py``)."""
        if self.model is not None:
            return
        from transformers import AutoModelForCausalLM

        with empty_weights():
            self.model = AutoModelForCausalLM.from_config(self.config, dtype=self.dtype_override)
        load_generation_config(self.model, self.directory)  # its EOS ids and defaults, as from_pretrained has them
        if self._trainer is None:
            return  # load_from_checkpoint: on_load_checkpoint loads the weights once the checkpoint is seen to fit
        if not hasattr(self.trainer.strategy, "transform"):  # a plain Lightning strategy: load it here
            self.load_own_weights()
            rank_zero_info("CausalLM loaded its weights itself; LowPrecisionStrategy would quantize them as they load.")
            if self.device_mesh is not None:  # Lightning's ModelParallelStrategy: configure_model shards
                blocks = shard_pretrained_blocks(self, self.model, self.device_mesh)
                destroy_process_group_at_exit(self.trainer.strategy)  # Lightning: for NCCL only; gloo aborted at exit
                rank_zero_info(f"CausalLM: FSDP2 on {len(blocks)} blocks and the module as the root.")

    def load_own_weights(self) -> None:
        """Under a plain Lightning strategy, stream the weights in here; a load that fails drops the model still on
        the meta device, whose ``.cpu()`` in Lightning's teardown would otherwise fail ("Cannot copy out of meta
        tensor") and hide this error (the bad checkpoint key or file) behind its own."""
        try:
            load_pretrained(self, self.directory, expected_prefix=PREFIX)
        except BaseException:
            self.model = None
            raise

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Outside a Trainer (``CausalLM.load_from_checkpoint``): a checkpoint of the whole model loads, without
        reading the pretrained weights it replaces where it holds every one; one only the strategy can load
        (adapters, quantized weights) is refused in one paragraph (``standalone_load``). Under a Trainer the strategy
        restores the checkpoint."""
        if self._trainer is not None or self.model is None:
            return
        holds_every_weight = check_loads_without_strategy(set(self.state_dict()), checkpoint, self.directory)
        if holds_every_weight:
            storage_to_fill(self.model)  # Lightning's load_state_dict copies every weight in next
        else:
            self.load_own_weights()

    def on_fit_start(self) -> None:
        self.resolve_loss_kernel()

    def on_validation_start(self) -> None:
        self.resolve_loss_kernel()

    def resolve_loss_kernel(self) -> None:
        """Once, on the device, after the strategy transformed the model: Liger's fused loss or PyTorch's; refuses
        ``loss_kernel="liger"`` where it cannot run, before any step (``liger_loss.py``)."""
        if self.loss_kernel_in_use is None:
            kernel = self.hparams.loss_kernel
            chosen = choose_loss_kernel(kernel, self.device)
            self.loss_kernel_in_use = check_head(kernel, chosen, self.model.get_output_embeddings())

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}
        return forward_batch(self.model, batch).logits

    def loss_sum(self, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = forward_batch(self.model.base_model, batch).last_hidden_state
        head = self.model.get_output_embeddings()
        if self.loss_kernel_in_use == "liger":
            return liger_loss_sum(head, hidden, batch["labels"])
        chunk, grouped = self.loss_chunk, self.grouped_cross_entropy
        return causal_lm_loss_sum(head, hidden, batch["labels"], chunk, self.loss_fn, grouped)

    @property
    def memory_saving_paths(self) -> frozenset[str]:
        """The strategy's ``memory_saving`` paths this module's loss takes (``configure_memory_saving``)."""
        chunked = {"chunked_loss"} if self.hparams.loss_chunk_size == AUTO else set()
        return frozenset({"grouped_cross_entropy", *chunked})

    def configure_memory_saving(self, paths: frozenset[str]) -> None:
        """Called by the strategy's transform with the ``memory_saving`` paths that are on: the cross-entropy in
        row groups or ``F.cross_entropy`` on fp32 logits; with ``loss_chunk_size="auto"``, chunks or all at once."""
        self.grouped_cross_entropy = "grouped_cross_entropy" in paths
        if self.hparams.loss_chunk_size == AUTO:
            self.loss_chunk = AUTO_LOSS_CHUNK if "chunked_loss" in paths else None

    def compile_loss(self, options: dict[str, Any]) -> None:
        """Called by the strategy's ``compile=``: the output head and cross-entropy, one chunk at a time (not Liger's
        kernel, fused already)."""
        self.loss_fn = torch.compile(functools.partial(chunk_loss, traced=True), **options)

    def simulate_compiled_loss(self) -> None:
        """``compile_loss`` in ``estimate_memory``'s fake step, where nothing compiles: a stand-in with the memory of
        the compiled loss (``compiled_chunk_loss_standin``)."""
        self.loss_fn = compiled_chunk_loss_standin

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss_sum, tokens = self.loss_sum(batch)
        self.log("train/loss", loss_sum.detach() / tokens.clamp(min=1))  # this micro-batch's, on this rank
        return self.token_mean.scaled(self.trainer, loss_sum, tokens)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        stepped = (param for group in optimizer.param_groups for param in group["params"])  # not every module's
        step_loss = self.token_mean.normalize_gradients(self.trainer, stepped)
        if step_loss is not None:  # the loss the step optimized: every micro-batch and rank, per target token
            self.log("train/step_loss", step_loss, prog_bar=True)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        loss_sum, tokens = self.loss_sum(batch)
        if tokens > 0:
            self.val_nll.update(loss_sum / tokens, weight=tokens)

    def on_validation_epoch_end(self) -> None:
        nll = self.val_nll.compute()
        self.val_nll.reset()
        # compute() is already the token-weighted mean over every rank: sync_dist averages equal values (one scalar
        # all-reduce each) and keeps Lightning from advising it on every validation of a multi-rank run.
        self.log("val/loss", nll, sync_dist=True)
        self.log("val/perplexity", torch.exp(nll), prog_bar=True, sync_dist=True)

    def configure_optimizers(self) -> dict[str, Any]:
        params = [p for p in self.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=self.hparams.lr, weight_decay=self.hparams.weight_decay)
        total = max(1, int(self.trainer.estimated_stepping_batches))
        schedule = warmup_cosine(self.hparams.warmup_steps, total, self.hparams.min_lr_ratio)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def warmup_cosine(warmup_steps: int, total_steps: int, min_ratio: float):
    """LR multiplier at each optimizer step: linear from 1/warmup to 1, then cosine down to ``min_ratio``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor
