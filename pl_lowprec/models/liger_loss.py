"""``CausalLM(loss_kernel="liger")``: the output head and cross-entropy as Liger-Kernel's fused linear cross-entropy.

Liger's ``liger_fused_linear_cross_entropy`` takes the hidden states and the head's weight and never materialises
the logits: it walks the tokens in chunks of about ``tokens x hidden / vocab`` rows, computes each chunk's logits,
loss and logits gradient in one Triton kernel, and forms the gradients of the hidden states (and of the head, if
it trains) in forward. What it keeps for backward is the hidden states' gradient, ``tokens x hidden``: at
Llama-3's vocabulary 63x less than one chunk-free copy of the bf16 logits. TRL, axolotl and LLaMA-Factory plug
it in the same way. Its loss is the same summed next-token cross-entropy as ``chunked_loss.py`` computes (fp32
softmax over the logits in the compute dtype, ``-100`` ignored, ``reduction="sum"``: ``TokenMeanLoss`` makes the
token mean across accumulation and ranks), so the two are interchangeable: ``tests/models/test_liger_loss.py``
compares them on a GPU.

Used on CUDA only (Triton), with a plain ``nn.Linear`` head (frozen or trained, tied to the embeddings or not,
with or without bias); ``loss_chunk_size`` is then unused, since Liger chunks itself. ``"auto"`` takes it where it
can and otherwise says in one line why not and keeps PyTorch's path; ``"liger"`` refuses, before any step, where
it cannot. Liger's kernel syncs once per call (it counts the target tokens with ``.item()``) and is not compiled
by ``compile=`` (the sync would break the graph; the kernel is fused already).
"""

from __future__ import annotations

from typing import Literal, get_args

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from pl_lowprec._imports import import_liger_fused_linear_cross_entropy, liger_missing
from pl_lowprec.models.token_loss import IGNORE_INDEX

LossKernel = Literal["torch", "liger", "auto"]
LOSS_KERNELS: tuple[str, ...] = get_args(LossKernel)
FIX = "Use loss_kernel='torch' (PyTorch's cross-entropy, in chunks of loss_chunk_size) or 'auto'"


def check_loss_kernel(value: object) -> None:
    if value not in LOSS_KERNELS:
        raise ValueError(
            f"CausalLM(loss_kernel={value!r}) is not valid: use 'torch' (default: the output head and PyTorch's"
            " cross-entropy, in chunks of loss_chunk_size), 'liger' (Liger-Kernel's fused linear cross-entropy, which"
            " never holds the logits; CUDA, pip install \"pl_lowprec[liger]\") or 'auto' (Liger where it runs)."
        )


def device_problem(device: torch.device) -> str | None:
    """Why Liger's kernel cannot run on ``device`` (a sentence), or ``None``."""
    if device.type != "cuda":
        return (
            f"Liger-Kernel's kernels are written in Triton and run on CUDA GPUs only, and this run is on {device.type}"
        )
    return liger_missing()


def head_problem(head: nn.Module | None) -> str | None:
    """Why Liger's kernel cannot take ``head`` as the output layer (a sentence), or ``None``: it reads a plain
    ``(vocab, hidden)`` weight, so not a quantized, LoRA-wrapped, float8 or sharded (DTensor) layer."""
    if type(head) is not nn.Linear:
        return (
            f"the output head is a {type(head).__name__}, not a plain torch.nn.Linear (a quantized, LoRA-wrapped or"
            " float8 head computes its own matmul, which Liger's kernel would bypass)"
        )
    if is_traceable_wrapper_subclass(head.weight):
        return f"the output head's weight is a {type(head.weight).__name__} (sharded or quantized), not a plain tensor"
    return None


def choose_loss_kernel(kernel: str, device: torch.device) -> Literal["torch", "liger"]:
    """What ``loss_kernel`` means on ``device``: ``"auto"`` falls back to ``"torch"`` saying why in one line;
    ``"liger"`` where it cannot run is refused with the reason and the fix."""
    if kernel == "torch":
        return "torch"
    problem = device_problem(device)
    if problem is None:
        return "liger"
    if kernel == "auto":
        rank_zero_info(f"CausalLM(loss_kernel='auto'): {problem}; the loss runs as PyTorch's cross-entropy.")
        return "torch"
    raise RuntimeError(f"CausalLM(loss_kernel='liger'): {problem}. {FIX}.")


def check_head(kernel: str, chosen: Literal["torch", "liger"], head: nn.Module | None) -> Literal["torch", "liger"]:
    """After the strategy transformed the model: the head Liger would read. Same rules as ``choose_loss_kernel``."""
    if chosen == "torch":
        return "torch"
    problem = head_problem(head)
    if problem is None:
        rank_zero_info(
            "CausalLM: the output head and cross-entropy run as Liger-Kernel's fused linear cross-entropy (the logits"
            " are never held; loss_chunk_size is unused)."
        )
        return "liger"
    if kernel == "auto":
        rank_zero_info(f"CausalLM(loss_kernel='auto'): {problem}; the loss runs as PyTorch's cross-entropy.")
        return "torch"
    raise ValueError(f"CausalLM(loss_kernel='liger'): {problem}. {FIX}.")


def liger_loss_sum(head: nn.Linear, hidden: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed loss of position t predicting ``labels[t + 1]`` and the number of target tokens, as
    ``causal_lm_loss_sum`` returns them, through Liger's fused kernel."""
    fused_linear_cross_entropy = import_liger_fused_linear_cross_entropy()
    targets = labels[:, 1:]
    rows = hidden[:, :-1].reshape(-1, hidden.size(-1))  # (tokens, hidden): Liger walks the rows in chunks
    loss = fused_linear_cross_entropy(
        rows, head.weight, targets.reshape(-1), bias=head.bias, ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return loss, (targets != IGNORE_INDEX).sum()
