"""A warning where weights train in half precision though the precision says fp32.

transformers 5 builds ``from_config`` in the config's ``dtype`` (most hub configs say bfloat16), where 4.x built
fp32; a module of one's own that builds its model so, under Lightning's default ``precision="32-true"``, trains
bf16 weights with no fp32 copy: a LoRA classifier's head, and under ``lowprec_fsdp`` the adapters too (torchao's
NF4 gets adapters in its own dtype). An AdamW update smaller than half a bf16 step of its weight (about 0.4% of
it) is rounded away. Under a mixed precision the transform keeps trainable weights in fp32; under
``"bf16-true"`` half-precision training is what was asked for.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import nn

from pl_lowprec.transforms.dtypes import HALF_DTYPES

FULL_PRECISIONS = ("32-true", "32", "64-true", "64")
_warned: set[str] = set()  # each warning once per process: plan and estimate run the transform per candidate


def warn_half_trainable(model: nn.Module, precision: Any) -> list[str]:
    """Under an fp32/fp64 precision, warn naming the trainable weights held in half precision; return them."""
    if str(precision) not in FULL_PRECISIONS:
        return []
    half = [n for n, p in model.named_parameters() if p.requires_grad and p.dtype in HALF_DTYPES]
    if half:
        dtype = str(model.get_parameter(half[0]).dtype).removeprefix("torch.")
        shown = ", ".join(half[:3]) + (f", ... ({len(half)} in all)" if len(half) > 3 else "")
        message = (
            f"precision={str(precision)!r}, but {type(model).__name__} holds trainable weights in {dtype} ({shown}):"
            " they train with no fp32 copy, and an update under half a step of their precision is lost. The"
            " model's weights are half precision (transformers builds from_config in the config's dtype). Use"
            f" AMPPrecision('auto') or '{'bf16' if dtype == 'bfloat16' else '16'}-mixed' (trainable weights kept in"
            " fp32, the rest computing in half), or build the model in fp32 (dtype=torch.float32)."
        )
        if message not in _warned:
            _warned.add(message)
            rank_zero_warn(message)
    return half
