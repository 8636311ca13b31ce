"""The fused LoRA SwiGLU MLP gives the unfused path's loss and gradients, and saves fewer bytes.

The reference is the same model without the fusion (peft's LoRA layers, bitsandbytes' matmul, autograd). Small
blocks force several row blocks in forward and column blocks in backward, so the block loops are exercised.
On the 2-core EPYC this was written on, every gradient is equal bit for bit; the tolerance allows two bf16
roundings, since other CPUs' bf16 matmul kernels may sum blocks in their own order (a wrong block or a wrong term
is off by far more: checked by breaking each)."""

import pytest
import torch
from loading_helpers import llama_config
from qlora_helpers import autocast_step

from pl_lowprec.transforms import fused_lora_mlp
from pl_lowprec.transforms.autocast_activations import keep_activations_in_compute_dtype
from pl_lowprec.transforms.frozen_dtype import cast_frozen_weights
from pl_lowprec.transforms.fused_lora_mlp import fuse_lora_mlps
from pl_lowprec.transforms.lora import inject_lora, prepare_for_kbit_training
from pl_lowprec.transforms.quantization import QuantizationConfig, quantize_model

pytest.importorskip("peft")


def _model(quantization: str | None, fuse: bool, lora: dict | None = None, hidden: int = 128, device: str = "cpu"):
    """A bf16 Llama (MLP 3 x hidden) with LoRA on every linear layer, prepared as under bf16-mixed."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(llama_config(hidden_size=hidden, layers=2)).to(torch.bfloat16).to(device)
    if quantization is not None:
        quantize_model(model, QuantizationConfig.from_mode(quantization), torch.bfloat16, torch.device(device))
    inject_lora(model, lora or {"r": 4, "lora_alpha": 12})  # scaling 3: not a power of two
    prepare_for_kbit_training(model, mixed_precision=True)
    torch.manual_seed(1)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)  # peft starts B at zero: give every adapter a gradient
    cast_frozen_weights(model, torch.bfloat16)  # as the strategy does: frozen layers also run outside autocast
    keep_activations_in_compute_dtype(model)
    if fuse:
        assert fuse_lora_mlps(model) == 2
    return model


@pytest.mark.parametrize(
    ("quantization", "hidden", "device"),
    [
        (None, 128, "cpu"),
        ("nf4-dq", 128, "cpu"),
        ("fp4", 128, "cpu"),
        ("nf4-dq", 80, "cpu"),  # 80, 240: rows not whole 4-bit blocks
        pytest.param("nf4-dq", 128, "cuda", marks=pytest.mark.cuda),  # bitsandbytes' CUDA dequantization
    ],
)
def test_fused_mlp_equals_the_unfused_one(monkeypatch, quantization, hidden, device):
    monkeypatch.setattr(fused_lora_mlp, "CHUNK_ELEMENTS", 64 * 64)  # 3 column blocks, 4 row blocks of down
    calls = []
    apply = fused_lora_mlp._LoraSwiGLU.apply
    monkeypatch.setattr(fused_lora_mlp._LoraSwiGLU, "apply", lambda *a: calls.append(1) or apply(*a))
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0)).to(device)
    loss_ref, grads_ref, saved_ref = autocast_step(_model(quantization, fuse=False, hidden=hidden, device=device), ids)
    assert not calls
    loss, grads, saved = autocast_step(_model(quantization, fuse=True, hidden=hidden, device=device), ids)
    assert len(calls) == 2  # one per block
    assert set(grads) == set(grads_ref) and len(grads) == 2 * 7 * 2
    torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=0)
    for name, grad in grads.items():
        reference = grads_ref[name]
        atol = 2**-7 * reference.abs().max().item()
        torch.testing.assert_close(grad, reference, rtol=2**-7, atol=atol, msg=name)
    assert saved < 0.85 * saved_ref, (saved, saved_ref)


def test_unfusable_layers_and_calls_take_the_module_forward(monkeypatch):
    calls = []
    apply = fused_lora_mlp._LoraSwiGLU.apply
    monkeypatch.setattr(fused_lora_mlp._LoraSwiGLU, "apply", lambda *a: calls.append(1) or apply(*a))
    ids = torch.randint(0, 256, (2, 16))
    dropout = _model("nf4", fuse=False, lora={"r": 4, "lora_alpha": 8, "lora_dropout": 0.1})
    assert fuse_lora_mlps(dropout) == 2  # hooked, but dropout is not fused: peft's own path runs
    autocast_step(dropout, ids)
    model = _model("nf4", fuse=True)
    model(input_ids=ids)  # outside autocast
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids)  # no gradients recorded
    assert not calls
    autocast_step(model, ids)
    assert len(calls) == 2
    assert fuse_lora_mlps(model) == 0  # idempotent


def test_weights_with_their_own_matmul_are_not_fused():
    """torchao's NF4 weights (FSDP2's 4-bit storage) dequantize in their own ``linear``: peft's path runs."""
    pytest.importorskip("torchao")
    from pl_lowprec._imports import import_torchao_nf4

    model = _model(None, fuse=True, hidden=256)
    mlp = model.model.layers[0].mlp
    assert fused_lora_mlp._fusable_layers(mlp) is not None
    base = mlp.up_proj.get_base_layer()
    nf4 = import_torchao_nf4().to_nf4(base.weight.detach())
    base.weight = torch.nn.Parameter(nf4, requires_grad=False)
    assert fused_lora_mlp._fusable_layers(mlp) is None
