"""The one precision -> dtype map, dtype names as YAML writes them (``"bfloat16"``, ``"torch.float16"``), and
the one way a parameter is upcast in place."""

from __future__ import annotations

from typing import Any

import torch

HALF_DTYPES = (torch.float16, torch.bfloat16)  # what mixed precision computes in


def upcast_to_fp32(param: torch.nn.Parameter) -> None:
    """``param`` in fp32, the same ``Parameter`` object (ties and references kept). A DTensor (a rank's rows under
    FSDP2) is swapped whole: ``param.data = ...`` changes its dtype but not its local rows', which FSDP2 gathers."""
    if hasattr(param, "placements"):
        torch.utils.swap_tensors(param, torch.nn.Parameter(param.detach().float(), requires_grad=param.requires_grad))
    else:
        param.data = param.data.float()


PRECISION_DTYPES: dict[str, torch.dtype] = {
    "16-mixed": torch.float16,
    "bf16-mixed": torch.bfloat16,
    "16-true": torch.float16,
    "bf16-true": torch.bfloat16,
    "32-true": torch.float32,
    "64-true": torch.float64,
}


def dtype_of_precision(precision: str) -> torch.dtype:
    """The compute dtype of a Trainer precision string (``"bf16-mixed"`` -> bfloat16, unknown -> float32)."""
    return PRECISION_DTYPES.get(str(precision), torch.float32)


def compute_dtype_of(precision_plugin: Any) -> torch.dtype:
    """The dtype a precision plugin computes in: its own ``compute_dtype``, else from its precision string."""
    own = getattr(precision_plugin, "compute_dtype", None)
    if isinstance(own, torch.dtype):
        return own
    return dtype_of_precision(precision_plugin.precision)


def to_dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    """A ``torch.dtype`` from a dtype or its name; ``None`` stays ``None``. A name that is no dtype is an error."""
    if value is None or isinstance(value, torch.dtype):
        return value
    resolved = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"{value!r} is not a torch dtype; use a name such as 'bfloat16', 'float16' or 'uint8'.")
    return resolved
