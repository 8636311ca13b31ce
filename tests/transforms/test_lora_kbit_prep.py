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


def test_a_ranks_rows_upcast_for_mixed_precision_are_fp32_in_their_local_rows_too(tmp_path):
    """FSDP2 gathers a DTensor's local rows: ``param.data = param.data.float()`` left them bf16 under an fp32
    DTensor, so a bias trained under ``bias='lora_only'`` got bf16 gradients beside fp32 LoRA ones and FSDP2's
    reduce-scatter failed; norms computed in bf16 while the log said fp32."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from pl_lowprec.distributed.mesh import local_rows

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        linear, norm = torch.nn.Linear(8, 8).bfloat16(), torch.nn.LayerNorm(8).bfloat16()
        linear.weight.requires_grad_(False)
        for module, attr in ((linear, "bias"), (norm, "weight")):
            param = getattr(module, attr)
            setattr(module, attr, torch.nn.Parameter(local_rows(param.detach(), mesh), param.requires_grad))
        model = torch.nn.Sequential(linear, norm)
        assert prepare_for_kbit_training(model, mixed_precision=True) == 3 * 8 * 2  # bias, norm weight and bias
        for param in (linear.bias, norm.weight):
            assert param.dtype == torch.float32 and param.to_local().dtype == torch.float32
        assert linear.bias.requires_grad and linear.weight.dtype == torch.bfloat16  # frozen: left as it was
    finally:
        dist.destroy_process_group()
