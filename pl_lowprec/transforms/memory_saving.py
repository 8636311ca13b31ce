"""``memory_saving=``: the exact memory-saving paths, on, off, by name, or chosen for the device (``"auto"``).

Each path keeps less for backward and does more work, so it costs time; none changes what is learned beyond the
order of floating-point sums (their tests compare against the plain path):

- ``fused_mlp``: a SwiGLU MLP whose projections carry LoRA runs as one autograd Function that keeps only the gate
  and up outputs (``fused_lora_mlp.py``); the plain path is peft's layers and autograd;
- ``recomputed_norms``: norms keep only their half-precision input and redo their ops in backward, a few rows at a
  time (``autocast_activations.py``); the plain path is the norm's own autograd, which keeps its fp32 copies;
- ``grouped_cross_entropy``: a module's cross-entropy in fp32 a few rows at a time, with no fp32 copy of the
  logits (``models/cross_entropy.py``); the plain path is ``F.cross_entropy(logits.float())``, as Hugging Face's
  loss computes it;
- ``chunked_loss``: the output head and loss over a few positions at a time, each recomputed in backward
  (``CausalLM(loss_chunk_size="auto")``: 256 positions); the plain path computes every position's logits at once.

The first two are the strategy's own transforms, with LoRA under mixed precision. The last two belong to the
module's loss: a ``LightningModule`` takes them by defining ``memory_saving_paths`` (the names it switches) and
``configure_memory_saving(paths)``, which the transform calls with the paths that are on (``CausalLM`` does).

``"auto"``: the strategy chooses, before loading, the fastest settings whose predicted peak fits the device
(``pl_lowprec.memory.fastest``); where nothing chooses (``estimate_memory``, ``ModelTransform`` on its own), it
means every path, the memory-saving side.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, get_args

MemorySavingPath = Literal["fused_mlp", "recomputed_norms", "grouped_cross_entropy", "chunked_loss"]
MemorySavingArg = bool | Literal["auto"] | Iterable[MemorySavingPath]
PATHS: tuple[str, ...] = get_args(MemorySavingPath)
ALL_PATHS = frozenset(PATHS)
AUTO = "auto"


def memory_saving_paths(value: object) -> frozenset[str] | Literal["auto"]:
    """``memory_saving=`` as the set of paths that are on, or ``"auto"``; a clear error for anything else."""
    if value == AUTO or value is True or value is False:
        return value if value == AUTO else (ALL_PATHS if value else frozenset())
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        names = list(value)
        unknown = [n for n in names if n not in PATHS]
        if not unknown:
            return frozenset(names)
        value = unknown[0] if len(unknown) == 1 else unknown
    raise ValueError(
        f"memory_saving={value!r} is not valid: use 'auto' (the fastest settings that fit the device, chosen before"
        " loading), True (every memory-saving path), False (none), or a list of the paths to turn on:"
        f" {', '.join(PATHS)}."
    )
