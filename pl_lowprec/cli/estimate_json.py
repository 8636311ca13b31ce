"""``pl-lowprec estimate --json``: the estimate as one JSON object on stdout, for scripts (a sweep over configs,
a CI memory budget), the lines meant for a person moved to stderr.

The fields are the table's, in bytes and seconds, under names that do not change with its wording.
"""

from __future__ import annotations

from typing import Any

from pl_lowprec.memory.estimate import MemoryEstimate


def estimate_record(estimate: MemoryEstimate, precision: str, notes: list[str]) -> dict[str, Any]:
    """The estimate's figures as plain JSON types: bytes as integers, the step time in seconds (``None`` where it
    is not predicted), and the lines printed above the table as ``notes``."""
    step = estimate.step_time
    return {
        "peak_bytes": estimate.peak,
        "peak_phase": estimate.peak_phase,
        "host_peak_bytes": estimate.host_peak,
        "device": estimate.device,
        "world_size": estimate.world_size,
        "precision": precision,
        "parameters": estimate.parameters,
        "trainable_parameters": estimate.trainable_parameters,
        "optimizer": estimate.optimizer,
        "timeline_bytes": dict(estimate.timeline),
        "at_peak_bytes": dict(estimate.peak_split),
        "components_bytes": estimate.as_dict(),
        "step_seconds": None if step is None else step.seconds,
        "step_time_on": estimate.time_on,
        "notes": notes,
    }
