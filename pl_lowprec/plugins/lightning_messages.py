"""Lightning's advice to set ``torch.set_float32_matmul_precision``, held back under ``AMPPrecision``.

Lightning's CUDA accelerator logs it on every run on a GPU with tensor cores while fp32 matmuls are at
"highest". Under autocast the matmuls already run in bf16 or fp16, so the advice does not apply (and
``AMPPrecision(float32_matmul_precision=...)`` is where to change the rest). The filter drops that one message
while an ``AMPPrecision`` exists; it is logged as before in a process without one.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any

# rank_zero_info logs through whichever of these lightning.fabric / lightning.pytorch last installed
LOGGERS = ("lightning.fabric.utilities.rank_zero", "lightning.pytorch.utilities.rank_zero")
ADVICE = "To properly utilize them, you should set `torch.set_float32_matmul_precision"

_plugins: weakref.WeakSet[Any] = weakref.WeakSet()


class _HideMatmulAdvice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not (len(_plugins) and ADVICE in str(record.msg))


_FILTER = _HideMatmulAdvice()


def hide_fp32_matmul_advice(plugin: Any) -> None:
    """Hold back the advice for as long as ``plugin`` lives."""
    _plugins.add(plugin)
    for name in LOGGERS:
        logger = logging.getLogger(name)
        if _FILTER not in logger.filters:
            logger.addFilter(_FILTER)
