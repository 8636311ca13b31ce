"""``pl-lowprec plan --json``: the plan as one JSON object on stdout, for scripts (a sweep over budgets, a CI check
that a config still fits), the table and every other line moved to stderr.

The chosen candidate's figures are ``estimate --json``'s (``estimate_record``), under the same names; each
candidate adds its settings, whether it fits and its predicted step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pl_lowprec.cli.estimate_json import estimate_record
from pl_lowprec.memory.plan import Candidate, MemoryPlan, Settings


def settings_record(settings: Settings) -> dict[str, Any]:
    """What a candidate sets, as the written config would (``None``: as the config gives it), and in words."""
    return {
        "micro_batch": settings.micro_batch,
        "accumulate_grad_batches": settings.accumulate,
        "checkpointing": settings.checkpointing,
        "memory_saving": sorted(settings.memory.paths),
        "optimizer": settings.optimizer,
        "activation_offloading": settings.activation_offloading,
        "quantization": settings.quantization,
        "described": settings.describe(),
    }


def candidate_record(candidate: Candidate) -> dict[str, Any]:
    return {
        "settings": settings_record(candidate.settings),
        "fits": candidate.fits,
        "peak_bytes": candidate.peak,
        "step_seconds": candidate.step.seconds,
    }


def plan_record(plan: MemoryPlan, precision: str, devices: int, out: Path | None) -> dict[str, Any]:
    """The plan's budget, the chosen candidate (``None`` where nothing fits) with its full estimate, every
    candidate ranked as the table ranks them, and the config written (``None`` without ``--out``)."""
    chosen = plan.chosen
    return {
        "budget_bytes": plan.budget,
        "margin": plan.margin,
        "limit_bytes": plan.limit,
        "devices": devices,
        "step_time_on": plan.time_on,
        "chosen": None if chosen is None else candidate_record(chosen),
        "chosen_estimate": None if chosen is None else estimate_record(chosen.estimate, precision, []),
        "candidates": [candidate_record(candidate) for candidate in plan.candidates],
        "out": None if out is None or chosen is None else str(out),
    }


def maximize_record(
    maximize: str, largest: int | None, settings: Settings, limit: int, out: str | None
) -> dict[str, Any]:
    """``--maximize``: the largest value that fits (``None``: not even the smallest) with the settings tried."""
    return {
        "maximize": maximize,
        "largest": largest,
        "limit_bytes": limit,
        "settings": settings_record(settings),
        "out": out if largest is not None else None,
    }
