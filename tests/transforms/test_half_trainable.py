"""Trainable weights held in bf16 under precision '32-true' (transformers 5 builds from_config in the config's
dtype) are named in a warning with the fix; under a mixed precision they are kept in fp32 and nothing is said."""

from __future__ import annotations

import warnings

import pytest
import torch
from lightning.pytorch.plugins.precision import Precision
from loading_helpers import llama_config

from pl_lowprec import AMPPrecision, LowPrecisionStrategy

pytest.importorskip("peft")


def _bf16_classifier():
    from transformers import LlamaForSequenceClassification

    return LlamaForSequenceClassification(llama_config(num_labels=2, pad_token_id=0)).to(torch.bfloat16)


def _transformed(plugin):
    model = _bf16_classifier()
    strategy = LowPrecisionStrategy(lora={"r": 4, "task_type": "SEQ_CLS"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        strategy.transform.apply(model, plugin, torch.device("cpu"))
    said = [str(w.message) for w in caught if "train with no fp32 copy" in str(w.message)]
    return model, said


def test_bf16_trainable_weights_under_32_true_are_named_with_the_fix(monkeypatch):
    from pl_lowprec.transforms import half_trainable

    monkeypatch.setattr(half_trainable, "_warned", set())
    model, said = _transformed(Precision())  # Lightning's default: "32-true"
    assert len(said) == 1
    assert said[0].startswith(
        "precision='32-true', but LlamaForSequenceClassification holds trainable weights in bfloat16 ("
    )
    assert "Use AMPPrecision('auto') or 'bf16-mixed'" in said[0]
    assert model.score.modules_to_save["default"].weight.dtype == torch.bfloat16  # kept as it was: no silent change
    assert _transformed(Precision())[1] == []  # once per process: plan and estimate transform every candidate


def test_under_a_mixed_precision_they_train_in_fp32_and_nothing_is_said():
    model, said = _transformed(AMPPrecision("bf16-mixed"))
    assert said == []
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 for p in trainable)
