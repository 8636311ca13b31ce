"""Lightning's precision aliases are estimated as Lightning runs them, and a precision it refuses is refused
(audit 64b, finding 1: ``"bf16"``, ``"16"`` and the typo ``"bf16-mix"`` were all estimated as fp32, +65%)."""

from __future__ import annotations

import functools

import pytest
import torch

from pl_lowprec import estimate_memory
from pl_lowprec.demo import TinyLlama
from pl_lowprec.transforms.dtypes import dtype_of_precision, unified_precision

BUILD = functools.partial(TinyLlama, hidden_size=64, intermediate_size=128, num_layers=2, max_len=32)
BATCH = {"input_ids": torch.zeros(2, 32, dtype=torch.long)}


def peak(precision) -> int:
    return estimate_memory(BUILD, BATCH, precision=precision, device="cpu", lora={"r": 4}, extrapolate=False).peak


@pytest.mark.filterwarnings("ignore:`precision=.*is supported for historical reasons")
def test_lightnings_aliases_are_estimated_as_the_precision_lightning_runs():
    assert peak("bf16") == peak("bf16-mixed") != peak("32-true")
    assert peak(16) == peak("16") == peak("16-mixed")
    assert peak("32") == peak("32-true")


@pytest.mark.filterwarnings("ignore:`precision=.*is supported for historical reasons")
def test_aliases_normalise_as_lightning_normalises_them():
    from lightning.fabric.connector import _convert_precision_to_unified_args

    for alias in ("bf16", "16", 16, "32", 32, "64", 64, "bf16-true", "16-true", "bf16-mixed"):
        assert unified_precision(alias) == _convert_precision_to_unified_args(alias)
    assert dtype_of_precision("bf16") == torch.bfloat16
    assert unified_precision("auto") == "auto"


@pytest.mark.parametrize("typo", ["bf16-mix", "fp32"])
def test_a_precision_lightning_refuses_is_refused_with_the_allowed_values_and_the_nearest(typo):
    with pytest.raises(ValueError) as refused:
        peak(typo)
    message = str(refused.value)
    assert f"precision={typo!r} is not a precision Lightning accepts" in message
    assert "Allowed: '16-mixed', 'bf16-mixed'" in message and "'bf16' (= 'bf16-mixed')" in message
    if typo == "bf16-mix":
        assert "Did you mean 'bf16-mixed'?" in message
    with pytest.raises(ValueError, match="is not a precision Lightning accepts"):
        dtype_of_precision(typo)  # never taken for fp32
