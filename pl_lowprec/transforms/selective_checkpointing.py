"""Op-level selective activation checkpointing: inside a checkpointed block, keep the outputs of the expensive ops
(matmuls, attention) and recompute only the cheap ones (norms, activations, rotary, elementwise) in backward.

Built on ``torch.utils.checkpoint.create_selective_checkpoint_contexts`` with torchtitan's list of ops to save
(its ``_save_list``: matmul, the fused attention kernels, ``_scaled_mm``, reduce-scatter), plus the CPU attention
kernel, the bias-adding matmul ``nn.Linear`` reaches, and bitsandbytes' fused 4-bit matmul (``gemm_4bit``, its
CPU path). Two departures, both to keep memory below "no checkpointing" with LoRA:

- A low-rank matmul is recomputed: one whose contraction dimension is under 1/8 of its output width (LoRA's
  ``lora_B``, contracting over the rank r). It costs r multiply-adds per output element to redo, and keeping its
  output would keep a second tokens x features tensor per adapted layer, beside the base layer's.
- torchtitan keeps every other ``mm`` only; here every full-rank matmul output is kept.

4-bit bases: the dequantization (bitsandbytes' ``dequantize_4bit``, torchao NF4's arithmetic) is in no list, so it
is recomputed, never kept: a dequantized weight would cost the weight's memory in compute dtype per layer. A
matmul's output is an activation (tokens x features) whatever its weight, so keeping it is what is wanted.

The kept outputs live in the checkpoint's own cache, not in autograd's saved tensors; the policy reports each to
``pl_lowprec.memory.activations`` so that ``MemoryTracker`` and ``estimate_memory`` count them. Under
``compile=`` the policy runs while the block is traced, and the compiled graph saves its tensors through autograd
at run time (counted there), so nothing is reported while tracing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._higher_order_ops import wrap
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from pl_lowprec.memory.activations import note_kept_outputs

MATMULS = frozenset({"aten::mm", "aten::addmm", "aten::_scaled_mm", "bitsandbytes::gemm_4bit"})
SAVED_OPS = MATMULS | {
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_fused_attention_overrideable",
    "_c10d_functional::reduce_scatter_tensor",
}
LOW_RANK_RATIO = 8  # contraction dim * 8 < output width: a LoRA up-projection, cheap to recompute


def save_matmuls_and_attention(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """``MUST_SAVE`` for a full-rank matmul or an attention kernel, ``PREFER_RECOMPUTE`` for everything else."""
    name = func.name() if hasattr(func, "name") else ""
    if name not in SAVED_OPS or (name in MATMULS and _is_low_rank(name, args)):
        return CheckpointPolicy.PREFER_RECOMPUTE
    if not ctx.is_recompute and not torch.compiler.is_compiling():  # traced: the compiled graph saves at run time
        note_kept_outputs(getattr(ctx, "op_output", None))
    return CheckpointPolicy.MUST_SAVE


def _is_low_rank(name: str, args: tuple[Any, ...]) -> bool:
    """Whether the matmul contracts over a dimension much smaller than its output width (``x @ w``)."""
    if name == "bitsandbytes::gemm_4bit":
        return False  # a base layer: (input, packed weight, ...)
    left, right = (args[1], args[2]) if name == "aten::addmm" else (args[0], args[1])
    contraction, width = left.shape[-1], right.shape[-1]
    return contraction * LOW_RANK_RATIO < width


def selective_contexts() -> tuple[Any, Any]:
    """The ``context_fn`` of a selectively checkpointed block (a fresh cache per call)."""
    return create_selective_checkpoint_contexts(save_matmuls_and_attention)


def recompute_everything(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """``PREFER_RECOMPUTE`` for every op: full checkpointing, written as a selective policy."""
    return CheckpointPolicy.PREFER_RECOMPUTE


def traced_full_contexts() -> tuple[Any, Any]:
    """The ``context_fn`` of a fully checkpointed region that ``torch.compile`` traces: every op recomputed, as plain
    checkpointing does, but tagged op by op as each dispatches. Before pytorch#177396 (torch 2.13 has it, 2.11 does
    not), plain checkpointing under compile tagged only the ops it saw before autograd.Functions were inlined; the
    ops inside one (bitsandbytes' ``MatMul4Bit``, this package's cross-entropy) were then saved, not recomputed. On
    an H100 (torch 2.11) 15 of Llama-3.2-1B's 16 compiled blocks kept their 4-bit matmul outputs: +2.9 GiB."""
    return create_selective_checkpoint_contexts(recompute_everything)


# torch with pytorch#177396 runs plain checkpointing under compile through this same policy itself (and warns when a
# context_fn is passed): the context is passed only where torch lacks it.
TORCH_TAGS_TRACED_CHECKPOINTS = hasattr(wrap, "_always_prefer_recompute")


def traced_full_checkpoint_args() -> dict[str, Any]:
    """``torch.utils.checkpoint`` arguments for a fully checkpointed region that ``torch.compile`` traces."""
    return {} if TORCH_TAGS_TRACED_CHECKPOINTS else {"context_fn": traced_full_contexts}
