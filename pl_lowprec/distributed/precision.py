"""Which precision plugins ``strategy="lowprec_fsdp"`` runs.

A plugin says so itself with a class attribute ``supports_fsdp2 = True`` (``AMPPrecision`` does: its loss scaler
agrees on overflows across the shards). Lightning's own plugins say nothing, so their support is the data below,
keyed by the exact class and its precision string: a subclass (``FSDPPrecision``, ``DoublePrecision``, ...) is
not assumed to shard like its parent.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision

# (class, precision) -> how a user asks for it
LIGHTNING_PRECISIONS_SHARDED: dict[tuple[type[Precision], str], str] = {
    (Precision, "32-true"): "Trainer(precision='32-true')",
    (HalfPrecision, "bf16-true"): "Trainer(precision='bf16-true')",
    (MixedPrecision, "bf16-mixed"): "Trainer(precision='bf16-mixed')",
}

SUPPORTED_PRECISIONS = ("AMPPrecision('bf16-mixed' | '16-mixed' | 'auto')", *LIGHTNING_PRECISIONS_SHARDED.values())


def supports_fsdp2(plugin: Any) -> bool:
    """The plugin's own answer when it gives one, else whether Lightning's plugin and precision are listed."""
    declared = getattr(type(plugin), "supports_fsdp2", None)
    if declared is not None:
        return bool(declared)
    return (type(plugin), str(getattr(plugin, "precision", ""))) in LIGHTNING_PRECISIONS_SHARDED


def check_precision(plugin: Any) -> None:
    """Refuse a precision plugin that cannot run under FSDP2 here, naming the ones that can."""
    if supports_fsdp2(plugin):
        return
    name = f"{type(plugin).__name__}({str(getattr(plugin, 'precision', ''))!r})"
    raise ValueError(
        f"strategy='lowprec_fsdp' cannot run {name}. It runs: {', '.join(SUPPORTED_PRECISIONS)}. fp16 needs"
        " AMPPrecision('16-mixed'), whose loss scaler agrees on overflows across the shards; pure fp16 weights"
        " ('16-true') have no scaler, and 64-bit or other precision plugins do not shard here."
    )
