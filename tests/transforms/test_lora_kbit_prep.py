"""Selective k-bit preparation: adapters and norms in fp32, embeddings and head left in bf16, less than peft."""

import pytest
import torch

from pl_lowprec.demo import TinyLlama
from pl_lowprec.memory.breakdown import parameter_bytes
from pl_lowprec.transforms.lora import inject_lora, prepare_for_kbit_training
from pl_lowprec.transforms.quantization import QuantizationConfig, quantize_model

peft = pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")


def _quantized_bf16():
    model = TinyLlama(hidden_size=64, intermediate_size=192, num_layers=1, num_heads=4).model.to(torch.bfloat16)
    quantize_model(model, QuantizationConfig.from_mode("nf4-dq"), torch.bfloat16, torch.device("cpu"))
    model.is_loaded_in_4bit = True
    return model


def test_selective_preparation_dtypes_and_savings_against_peft():
    ours = _quantized_bf16()
    inject_lora(ours, {"r": 4, "lora_alpha": 8})
    added = prepare_for_kbit_training(ours, mixed_precision=True)
    assert ours.model.embed_tokens.weight.dtype == torch.bfloat16 and ours.lm_head.weight.dtype == torch.bfloat16
    assert ours.model.norm.weight.dtype == torch.float32
    assert {p.dtype for n, p in ours.named_parameters() if "lora_" in n} == {torch.float32}
    assert added > 0

    theirs = peft.prepare_model_for_kbit_training(_quantized_bf16(), use_gradient_checkpointing=False)
    theirs = peft.get_peft_model(theirs, peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
    saved = sum(parameter_bytes(theirs).values()) - sum(parameter_bytes(ours).values())
    embed_and_head = 2 * 256 * 64  # parameters that peft holds in fp32 and pl_lowprec in bf16
    assert saved == embed_and_head * 2  # two bytes per parameter


def test_no_upcast_without_mixed_precision():
    model = _quantized_bf16()
    inject_lora(model, {"r": 4})
    assert prepare_for_kbit_training(model, mixed_precision=False) == 0
    assert model.model.norm.weight.dtype == torch.bfloat16
