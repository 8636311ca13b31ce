"""Setup lines silenced while candidates are simulated.

``plan_memory``, ``memory_budget=`` and the automatic settings (``fastest.fastest_fitting``: ``"auto"`` before
``fit`` loads, and ``pl-lowprec estimate``'s faster-settings line) simulate one step per candidate through the
strategy's own transform, whose INFO lines (``Quantized 14 linear layers to nf4-dq.``, ``LoRA on 14 layers; ...``)
would repeat once per candidate and describe models that are never built; the real run prints them once, when it
sets up, and a search reports itself in one line. ``pl-lowprec estimate`` simulates the config as it is, once, and
keeps them. This is the package's one way to silence them.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

from lightning_utilities.core import rank_zero


class _BelowWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING


@contextmanager
def quiet_setup_logs() -> Iterator[None]:
    """Lightning's ``rank_zero_info`` lines (what the package's setup logs with) are dropped inside."""
    logger = rank_zero.log
    below_warning = _BelowWarning()
    logger.addFilter(below_warning)
    try:
        yield
    finally:
        logger.removeFilter(below_warning)
