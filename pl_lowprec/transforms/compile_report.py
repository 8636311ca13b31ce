"""What ``torch.compile`` really did over a stretch of training: graphs compiled, recompiles, graph breaks, seconds.

Read from torch._dynamo's own records (its compilation metrics and its ``graph_break`` counter), not inferred from
what was asked: a block whose graph breaks, or that runs eagerly past dynamo's recompile limit, is asked to compile
and then runs (partly) eager, and only these records tell. They come from private modules of ``torch._dynamo``
that have kept their shape since torch 2.2; a field a release lacks reads as empty.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch._dynamo import utils as dynamo_utils


@dataclass(frozen=True)
class CompiledFrame:
    """One function dynamo compiled (its forward graph; AOTAutograd compiles the backward with it)."""

    function: str  # "chunk_loss (chunked_loss.py:32)"
    recompile_reason: str | None  # why an earlier graph of the same function did not fit, if it is a recompile
    failed: str | None  # dynamo gave up on the frame (it then runs eagerly): the error's type and first line


@dataclass(frozen=True)
class CompileActivity:
    """What dynamo did between ``CompileWatch()`` and ``CompileWatch.activity()``."""

    seconds: float
    frames: list[CompiledFrame] = field(default_factory=list)
    graph_breaks: dict[str, int] = field(default_factory=dict)  # the first line of each reason -> count

    @property
    def graphs(self) -> int:
        return sum(1 for f in self.frames if f.failed is None)

    @property
    def recompiles(self) -> list[CompiledFrame]:
        return [f for f in self.frames if f.recompile_reason is not None and f.failed is None]

    @property
    def failures(self) -> list[CompiledFrame]:
        return [f for f in self.frames if f.failed is not None]

    def graphs_by_function(self) -> str:
        """``"__call__ (checkpointing.py:38) 2, chunk_loss (chunked_loss.py:32) 2"``."""
        counts = Counter(f.function for f in self.frames if f.failed is None)
        return ", ".join(f"{name} {n}" for name, n in counts.items())

    def recompile_reasons(self, limit: int = 3) -> str:
        """The distinct reasons of the recompiles, the first ``limit`` of them, ``"; "``-joined."""
        reasons = list(dict.fromkeys(f"{f.function}: {f.recompile_reason}" for f in self.recompiles))
        more = f"; and {len(reasons) - limit} more" if len(reasons) > limit else ""
        return "; ".join(reasons[:limit]) + more

    def graph_break_reasons(self, limit: int = 3) -> str:
        shown = [f"{reason} (x{n})" for reason, n in list(self.graph_breaks.items())[:limit]]
        more = f"; and {len(self.graph_breaks) - limit} more" if len(self.graph_breaks) > limit else ""
        return "; ".join(shown) + more

    def first_step_line(self, blocks: int) -> str:
        """The line logged after the first optimizer step: what compiled, why anything compiled twice, the seconds."""
        if not self.graphs:
            return (
                f"torch.compile: nothing compiled up to the end of the first optimizer step ({blocks} blocks were"
                " wrapped): every compiled block ran eagerly."
            )
        why = f"; recompiled: {self.recompile_reasons()}" if self.recompiles else ""
        breaks = sum(self.graph_breaks.values())
        broken = f"{breaks} graph breaks (warned below)" if breaks else "no graph breaks"
        return (
            f"torch.compile: {self.graphs} graphs (each forward and backward) compiled in {self.seconds:.1f} s up to"
            f" the end of the first optimizer step ({blocks} blocks wrapped): {self.graphs_by_function()}{why};"
            f" {broken}. Later steps reuse them unless shapes change."
        )

    def later_line(self) -> str:
        """The line logged at the end of training about what compiled after the first optimizer step."""
        why = f" ({self.recompile_reasons()})" if self.recompiles else ""
        return (
            f"torch.compile: {self.graphs} more graphs ({self.seconds:.1f} s) after the first optimizer step:"
            f" {self.graphs_by_function()}{why}."
        )

    def broken_graphs_warning(self) -> str:
        """One paragraph naming what did not compile whole, and how to see where."""
        parts = []
        if self.graph_breaks:
            parts.append(
                f"torch.compile broke the graph {sum(self.graph_breaks.values())} times: {self.graph_break_reasons()}."
                " The code around each break runs eagerly, and a break inside a checkpointed block leaves that block"
                " uncompiled."
            )
        if self.failures:
            failed = "; ".join(dict.fromkeys(f"{f.function}: {f.failed}" for f in self.failures))
            parts.append(f"torch.compile gave up on {len(self.failures)} frames, which run eagerly: {failed}.")
        parts.append("TORCH_LOGS=graph_breaks,recompiles shows where.")
        return " ".join(parts)


class CompileWatch:
    """Marks a point in time; ``activity()`` is what dynamo did since."""

    def __init__(self) -> None:
        self.start_us = time.time_ns() // 1000
        self.seconds = compile_seconds()
        self.breaks = Counter(dynamo_utils.counters["graph_break"])

    def activity(self) -> CompileActivity:
        breaks = Counter(dynamo_utils.counters["graph_break"])
        breaks.subtract(self.breaks)
        reasons: Counter[str] = Counter()
        for reason, n in breaks.items():
            if n > 0:
                reasons[_break_reason(reason)] += n
        frames = [
            _frame(m)
            for m in dynamo_utils.get_compilation_metrics()
            if getattr(m, "is_forward", True) is not False
            and getattr(m, "co_name", None)
            and (getattr(m, "start_time_us", None) or 0) >= self.start_us
            and (getattr(m, "has_guarded_code", True) or getattr(m, "fail_type", None))  # not: a frame without ops
        ]
        return CompileActivity(compile_seconds() - self.seconds, frames, dict(reasons))


def compile_seconds() -> float:
    """Seconds torch.compile has spent compiling in this process (dynamo, AOTAutograd and the backend)."""
    return float(dynamo_utils.calculate_time_spent().get("total_wall_time", 0.0))


def _frame(metrics: Any) -> CompiledFrame:
    where = f"{Path(metrics.co_filename or '?').name}:{metrics.co_firstlineno}"
    reason = getattr(metrics, "recompile_reason", None)
    failed = None
    if getattr(metrics, "fail_type", None):
        failed = f"{metrics.fail_type}: {_first_line(metrics.fail_reason or '')}".rstrip(": ")
    return CompiledFrame(
        function=f"{metrics.co_name} ({where})",
        recompile_reason=_reason(reason) if reason else None,
        failed=failed,
    )


def _reason(text: str) -> str:
    """A recompile reason without dynamo's ``"0/1: "`` prefix and source comment: ``"tensor 'args[0]' ..."``."""
    line = _first_line(text)
    head, sep, rest = line.partition(": ")
    line = rest if sep and "/" in head and head.replace("/", "").isdigit() else line
    return line.split("  #", 1)[0].strip()


def _break_reason(text: str) -> str:
    """A graph break's kind and, where dynamo gives one, its explanation: ``"HOP: Non-nullified side effect:
    Attribute 'x' on an outer-scope object was changed ..."`` (at most 240 characters)."""
    kind = _first_line(text)
    explanation = next((line.strip() for line in text.splitlines() if line.strip().startswith("Explanation:")), "")
    text = f"{kind}: {explanation.removeprefix('Explanation:').strip()}" if explanation else kind
    return text if len(text) <= 240 else text[:237] + "..."


def _first_line(text: str) -> str:
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return ""
