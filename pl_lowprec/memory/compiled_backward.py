"""What the backward of a compiled, checkpointed block holds beyond the eager step's: ``compile=`` is not run in
the simulated step (nothing compiles on fake tensors), so its extra is added to the backward peak afterwards.

Inductor recomputes a checkpointed block and runs its backward as one graph, and holds more full-width buffers at
once than eager autograd does. Measured, in buffers of the block's widest activation (tokens x the widest linear
output, the MLP's intermediate width, in the compute dtype) above the eager step of the same blocks:

- 5.8 at Llama-3.2-1B and 5.3 at Llama-3.1-8B, batch 2 x 2048, on an H100 (torch 2.11, ``gpu_peers.py`` run 3);
- 4.75 on a CPU (torch 2.13), Llama-3.2-1B's blocks at 1 x 2048; 3.75 at 1 x 1024.

``COMPILED_BACKWARD_BUFFERS`` is fitted to the two GPU runs (predicted -0.7% and +0.3% there; +2.1% at 1B on an
H200, run 4). Held out on a GPU (H200, run 4), Qwen2.5-0.5B's shapes (qkv biases, 14 heads, MLP 4864, a 151,936
vocabulary) at batch 2 x 2048: 1.30 GiB predicted against 1.22 measured (+6.6%; its blocks held about 3.1 buffers,
not 5.5). On the CPU it over-predicts: +4.6% at 1B's blocks and 1 x 2048, +9.3% at 1 x 1024, +4.7% at a quarter of
their width (``tests/memory/test_compiled_backward.py``); Qwen2.5-0.5B's blocks +4.7% at 1 x 2048 and +4.3% at
1 x 1024. The buffer count depends on the block's shapes in a way two fitted models do not pin down; it errs
towards a fit. Blocks compiled without checkpointing get nothing added.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from pl_lowprec.transforms.checkpointing import is_checkpointed

COMPILED_BACKWARD_BUFFERS = 5.5
LABEL = "compiled backward buffers"


def compiled_backward_bytes(model: nn.Module, batch: Any, dtype: torch.dtype) -> int:
    """The extra bytes of a compiled checkpointed block's backward: ``COMPILED_BACKWARD_BUFFERS`` buffers of
    the micro-batch's tokens x the widest linear output of a checkpointed block, in ``dtype``; 0 where no block is
    checkpointed or the batch has no ``input_ids``."""
    blocks = [m for m in model.modules() if is_checkpointed(m)]
    widths = [m.out_features for b in blocks for m in b.modules() if isinstance(getattr(m, "out_features", None), int)]
    tokens = batch_tokens(batch)
    if not widths or not tokens:
        return 0
    return int(COMPILED_BACKWARD_BUFFERS * tokens * max(widths) * dtype.itemsize)


def batch_tokens(batch: Any) -> int:
    """The tokens of a micro-batch: its ``input_ids`` (a mapping's, or the batch itself as a tensor of ids)."""
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else batch
    if isinstance(ids, torch.Tensor) and not ids.is_floating_point():
        return ids.numel()
    return 0
