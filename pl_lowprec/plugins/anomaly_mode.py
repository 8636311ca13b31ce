"""torch's anomaly mode (``Trainer(detect_anomaly=True)``) beside fp16 loss scaling: an overflow is the scaler's.

Anomaly mode raises at the first NaN a backward function returns. Under fp16 loss scaling an overflow of the scaled
gradients (beyond fp16's 65504: inf, which the next matmul's backward turns into NaN) is such a NaN, and it is what
the scaler exists for: it skips that step and backs the scale off (a few times at the start of most fp16 runs, while
the scale settles). With anomaly mode on, the run stopped at the first one instead, as under Lightning alone, so
anomaly detection could not be used with fp16 at all. The scaled backward runs with anomaly mode's NaN check off:
an overflowing step is skipped as without it, and the rest of anomaly mode (the forward trace of any other error
in backward) stays on. ``AMPPrecision`` does so under any strategy, and the package's strategies for any plugin
with a scaler (Lightning's ``MixedPrecision`` on a GPU: ``Trainer(precision="16-mixed")``). A NaN that is no
overflow recurs at every scale: ``AMPPrecision``'s dynamic scaling ends the run with ``LossScaleCollapseError``
below ``min_scale``, and ``LossScaleMonitor`` stops it and names the module that first produced it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from weakref import WeakSet

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

NAN_CHECK_LEFT_TO_THE_SCALER = (
    "detect_anomaly=True with fp16 loss scaling ({plugin} with a GradScaler): torch's anomaly mode raises at the first"
    " NaN a backward returns, and an overflow of the scaled gradients (inf beyond fp16's 65504, NaN one op later)"
    " is one, which the loss scaler exists to skip (a few at the start of most fp16 runs, while the scale settles):"
    " the run would stop at the first, as under Lightning alone. So the scaled backward runs with anomaly mode's"
    " NaN check off (its forward traces of other backward errors stay on): an overflowing step is skipped and the"
    " scale backed off, as without detect_anomaly. A NaN that is no overflow recurs at every scale:"
    " AMPPrecision('16-mixed') stops the run with LossScaleCollapseError once its scale falls below min_scale, and"
    " pl_lowprec.LossScaleMonitor() stops it after max_consecutive_overflows and names the module whose output or"
    " input gradient first held inf/NaN. For torch's own NaN check, train with 'bf16-mixed' or '32-true'."
)

_told: WeakSet[Any] = WeakSet()  # the precision plugins whose runs were told


@contextmanager
def overflows_left_to_the_scaler(precision: Any) -> Iterator[None]:
    """Around a backward: where ``precision`` scales the loss and anomaly mode checks for NaN, the check is off
    inside (said once per plugin); elsewhere nothing changes."""
    if getattr(precision, "scaler", None) is None or not nan_check_on():
        yield
        return
    if precision not in _told:
        _told.add(precision)
        rank_zero_warn(NAN_CHECK_LEFT_TO_THE_SCALER.format(plugin=type(precision).__name__))
    with torch.autograd.set_detect_anomaly(True, check_nan=False):
        yield


def nan_check_on() -> bool:
    """Whether torch's anomaly mode is on and raises at a NaN in backward (``Trainer(detect_anomaly=True)``)."""
    return torch.is_anomaly_enabled() and torch.is_anomaly_check_nan_enabled()
