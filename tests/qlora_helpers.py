"""A tiny Llama LightningModule and data for the QLoRA tests (no downloads)."""

from __future__ import annotations

import lightning.pytorch as pl
import torch

from pl_lowprec.demo import TinyLlama


def tiny_llama(hidden_size: int = 64, layers: int = 2, **kwargs) -> TinyLlama:
    return TinyLlama(
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 3,
        num_layers=layers,
        num_heads=4,
        max_len=64,
        warmup_steps=1,
        **kwargs,
    )


def ids_loader(batches: int = 8, batch_size: int = 4, seq_len: int = 33, seed: int = 0):
    """Byte sequences with structure (repeated random phrases), so that a few steps visibly lower the loss."""
    g = torch.Generator().manual_seed(seed)
    phrases = torch.randint(0, 256, (4, 8), generator=g)
    rows = []
    for _ in range(batches * batch_size):
        picks = torch.randint(0, 4, (seq_len // 8 + 1,), generator=g)
        rows.append(phrases[picks].reshape(-1)[:seq_len])
    return torch.utils.data.DataLoader([{"input_ids": r} for r in rows], batch_size=batch_size)


class LossRecorder(pl.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))


class GradRecorder(pl.Callback):
    def __init__(self) -> None:
        self.grads: list[dict[str, torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.grads.append({n: p.grad.clone() for n, p in pl_module.named_parameters() if p.grad is not None})


def frozen_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor of the state dict that is not a trainable parameter (packed weights, absmax, ...)."""
    trainable = {n for n, p in module.named_parameters() if p.requires_grad}
    return {k: v.clone() for k, v in module.state_dict().items() if k not in trainable and torch.is_tensor(v)}


def autocast_step(model: torch.nn.Module, ids: torch.Tensor):
    """Loss and gradients of one bf16-autocast step of a causal LM, and the bytes autograd saved for backward."""
    saved: dict[int, int] = {}

    def pack(tensor):
        saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    autocast = torch.autocast(ids.device.type, dtype=torch.bfloat16)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), autocast:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, sum(saved.values())
