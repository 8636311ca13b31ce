"""The one precision -> dtype map, dtype names as YAML writes them (``"bfloat16"``, ``"torch.float16"``), and
the one way a parameter is upcast in place."""

from __future__ import annotations

from typing import Any

import torch
from lightning.fabric.connector import _convert_precision_to_unified_args

from pl_lowprec._did_you_mean import closest, did_you_mean

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


def unified_precision(precision: str | int) -> str:
    """``precision`` as Lightning's Trainer runs it: its aliases normalised by Lightning's own
    ``_convert_precision_to_unified_args`` (``"bf16"`` -> ``"bf16-mixed"``, ``"16"`` and ``16`` -> ``"16-mixed"``,
    ``"32"`` and ``32`` -> ``"32-true"``, ``"64"`` -> ``"64-true"``); ``"auto"`` (``AMPPrecision``'s) stays. A value
    Lightning refuses, or one with no dtype here (``"transformer-engine"``), is refused in one paragraph naming the
    allowed values and the nearest one."""
    if precision == "auto" or precision in PRECISION_DTYPES:
        return str(precision)
    try:
        unified = str(_convert_precision_to_unified_args(precision))  # type: ignore[arg-type]
    except ValueError:
        unified = None
    if unified in PRECISION_DTYPES:
        return unified
    allowed = [*PRECISION_DTYPES, *ALIASES, "auto"]
    hint = did_you_mean(closest(str(precision).lower(), allowed, cutoff=0.5))
    what = "is not a precision Lightning accepts" if unified is None else "has no dtype the estimate can simulate"
    raise ValueError(
        f"precision={precision!r} {what}.{hint} Allowed: {', '.join(repr(a) for a in PRECISION_DTYPES)}, Lightning's"
        " aliases 'bf16' (= 'bf16-mixed'), '16' or 16 (= '16-mixed'), '32' or 32 (= '32-true') and '64' or 64"
        " (= '64-true'), or 'auto' (AMPPrecision's choice for the device)."
    )


ALIASES = ("bf16", "16", "32", "64")  # Lightning's (_PRECISION_INPUT_STR_ALIAS), also as the ints 16, 32, 64


def dtype_of_precision(precision: str | int) -> torch.dtype:
    """The compute dtype of a Trainer precision (``"bf16-mixed"`` or its alias ``"bf16"`` -> bfloat16); a value
    Lightning refuses is refused (``unified_precision``), never taken for fp32."""
    return PRECISION_DTYPES[unified_precision(precision)]


def compute_dtype_of(precision_plugin: Any) -> torch.dtype:
    """The dtype a precision plugin computes in: its own ``compute_dtype``, else from its precision string (fp32
    for a plugin of Lightning's with no such string here, such as ``"transformer-engine"``)."""
    own = getattr(precision_plugin, "compute_dtype", None)
    if isinstance(own, torch.dtype):
        return own
    return PRECISION_DTYPES.get(str(precision_plugin.precision), torch.float32)


def to_dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    """A ``torch.dtype`` from a dtype or its name; ``None`` stays ``None``. A name that is no dtype is an error."""
    if value is None or isinstance(value, torch.dtype):
        return value
    resolved = getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(resolved, torch.dtype):
        raise ValueError(f"{value!r} is not a torch dtype; use a name such as 'bfloat16', 'float16' or 'uint8'.")
    return resolved
