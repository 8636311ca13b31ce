"""torch's anomaly mode (``Trainer(detect_anomaly=True)``) beside fp16 loss scaling: an overflow is the scaler's.

Anomaly mode raises at the first NaN a backward function returns. Under fp16 loss scaling an overflow of the scaled
gradients (beyond fp16's 65504: inf, which the next matmul's backward turns into NaN) is such a NaN, and it is what
the scaler exists for: it skips that step and backs the scale off (a few times at the start of most fp16 runs, while
the scale settles). With anomaly mode on, the run stopped at the first one instead, as under Lightning alone, so
anomaly detection could not be used with fp16 at all. The scaled backward runs with anomaly mode's NaN check off:
an overflowing step is skipped as without it, and the rest of anomaly mode (the forward trace of any other error
in backward) stays on. A NaN that is no overflow recurs at every scale: dynamic scaling then ends the run with
``LossScaleCollapseError`` below ``min_scale``, and ``LossScaleMonitor`` names the module that first produced it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

NAN_CHECK_LEFT_TO_THE_SCALER = (
    "detect_anomaly=True with fp16 loss scaling (AMPPrecision('16-mixed')): torch's anomaly mode raises at the first"
    " NaN a backward returns, and an overflow of the scaled gradients (inf beyond fp16's 65504, NaN one op later)"
    " is one, which the loss scaler exists to skip (a few at the start of most fp16 runs, while the scale settles):"
    " the run would stop at the first, as under Lightning alone. So the scaled backward runs with anomaly mode's"
    " NaN check off (its forward traces of other backward errors stay on): an overflowing step is skipped and the"
    " scale backed off, as without detect_anomaly. A NaN that is no overflow recurs at every scale: dynamic scaling"
    " stops the run with LossScaleCollapseError once the scale falls below min_scale, and"
    " pl_lowprec.LossScaleMonitor() (locate_overflow=True) names the module whose output or input gradient first"
    " held inf/NaN. For torch's own NaN check, train with 'bf16-mixed' or '32-true'."
)


def nan_check_on() -> bool:
    """Whether torch's anomaly mode is on and raises at a NaN in backward (``Trainer(detect_anomaly=True)``)."""
    return torch.is_anomaly_enabled() and torch.is_anomaly_check_nan_enabled()


@contextmanager
def nan_check_off() -> Iterator[None]:
    """Anomaly mode on without its NaN check inside; as it was after."""
    with torch.autograd.set_detect_anomaly(True, check_nan=False):
        yield
