"""Checks across the model arguments: combinations that no single transform can see are wrong."""

from __future__ import annotations

from typing import Any

from torch import nn

from pl_lowprec.transforms.fp8 import FP8Config
from pl_lowprec.transforms.qat import QATConfig


def check_linear_transforms(quantization: Any, qat: QATConfig | None, fp8: FP8Config | None) -> None:
    """quantization=, qat= and fp8= each replace the linear layers; torchao cannot stack them."""
    given = [name for name, value in (("quantization", quantization), ("qat", qat), ("fp8", fp8)) if value is not None]
    if len(given) < 2:
        return
    why = {
        frozenset({"quantization", "qat"}): "QAT fake-quantizes full-precision weights that train, while"
        " quantization= freezes them in bitsandbytes 4/8-bit, which torchao's fake quantizers cannot read."
        " For a quantized base with adapters use quantization= + lora=; for QAT on adapters use qat= + lora=.",
        frozenset({"quantization", "fp8"}): "float8 training casts high-precision weights to float8 in every"
        " matmul; bitsandbytes 4/8-bit weights are neither, and torchao's Float8Linear cannot wrap them.",
        frozenset({"qat", "fp8"}): "both replace the same nn.Linear layers (FakeQuantizedLinear vs Float8Linear)"
        " and torchao has no layer that does both. Train with fp8=, then quantize after training; or use qat=.",
    }
    pair = frozenset(given[:2])
    raise ValueError(f"{'= and '.join(given)}= cannot be combined: {why[pair]}")


def refuse_fitting_converted(model: nn.Module) -> None:
    """A QAT model converted at the end of an earlier fit holds quantized weights, which do not train."""
    trainer = getattr(model, "_trainer", None)
    if trainer is not None and trainer.state.fn == "fit":
        raise RuntimeError(
            "qat=: this model was converted to its quantized form at the end of an earlier fit, and quantized"
            " weights do not train. Fit a fresh model (or resume from a checkpoint written during QAT), or set"
            " QATConfig(convert_on_fit_end=False) to keep training the fake-quantized model."
        )
