"""A checkpointed block runs without the KV cache a Hugging Face model makes in training.

Most hub configs say ``use_cache: true``, so ``self.model(input_ids=..., labels=...)`` in a module's
``training_step`` builds a ``DynamicCache`` and hands it to every decoder layer. A checkpointed layer runs twice,
in forward and again in backward, and the second run appended its keys and values to the cache a second time: the
recompute then saw twice the keys, took transformers' cache-prefill path (a slice), and selective checkpointing
stopped at the first backward ("aten.slice.Tensor invocation index 4 encountered during backward but not found in
storage"); full checkpointing kept every layer's keys and values alive for the whole step. Hugging Face's own
gradient checkpointing (``GradientCheckpointingLayer``) drops the cache for the checkpointed call; so does this,
said once, for a block that writes the cache (``_can_checkpoint_with_cache`` unset, as transformers marks them).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_info

CACHE_ARGUMENTS = ("past_key_values", "layer_past")  # the names transformers' decoder layers take it by

_said = False


def without_cache(forward: Callable[..., Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` of a checkpointed block's call with no cache to write: ``None`` for it, ``use_cache=False``."""
    owner = getattr(forward, "__self__", None)
    if getattr(owner, "_can_checkpoint_with_cache", False):
        return kwargs
    dropped = [name for name in CACHE_ARGUMENTS if kwargs.get(name) is not None]
    if kwargs.get("use_cache"):
        dropped.append("use_cache")
    if not dropped:
        return kwargs
    if not torch.compiler.is_compiling():
        _say_once(type(owner).__name__ if owner is not None else "block")
    return {**kwargs, **{name: None for name in dropped if name != "use_cache"}} | (
        {"use_cache": False} if "use_cache" in dropped else {}
    )


def _say_once(block: str) -> None:
    global _said
    if _said:
        return
    _said = True
    rank_zero_info(
        f"The model was called in training with a KV cache (its config's use_cache is true): each checkpointed"
        f" {block} runs without it, as Hugging Face's gradient checkpointing does, since its recompute would write"
        " the cache again. Call the model with use_cache=False to make none."
    )
