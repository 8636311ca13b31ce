"""``forward_batch``: call a Hugging Face model on a ``TextDataModule`` batch, packed or padded, the one right way.

A packed batch (``TextDataModule(packing=True)``) keeps its samples apart only if the model gets the batch's
``position_ids``, no ``attention_mask``, and no cache: transformers 5.x derives the block-causal mask from
restarting positions only when ``attention_mask`` and ``past_key_values`` are both ``None``
(``masking_utils._preprocess_mask_arguments``), and a model whose config says ``use_cache: true`` (most hub
models) makes a cache in training too unless called with ``use_cache=False``. Then each sample attends to the ones
before it in its row, and nothing warns. ``CausalLM`` calls its model through this function; so can any module.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

MODEL_INPUTS = ("input_ids", "attention_mask", "position_ids")


def forward_batch(model: Callable[..., Any], batch: Mapping[str, torch.Tensor], **kwargs: Any) -> Any:
    """``model(input_ids=..., attention_mask=... or position_ids=..., use_cache=False, **kwargs)``: the batch's
    model inputs (a packed batch has ``position_ids`` and no ``attention_mask``, a padded one the reverse), never a
    cache. ``kwargs`` add what the batch does not decide, such as ``labels=batch["labels"]``::

        loss = forward_batch(self.model, batch, labels=batch["labels"]).loss
    """
    inputs = {name: batch[name] for name in MODEL_INPUTS if batch.get(name) is not None}
    return model(**inputs, use_cache=False, **kwargs)
