"""Under autocast, norms return their input's dtype and keep only their input; LoRA reads its input as it is.

The reference is the same model without the hooks: the adapters' gradients must be unchanged where only memory
changes (LoRA's input, a recomputed norm), and the saved activations fewer."""

import pytest
import torch
from loading_helpers import llama_config
from qlora_helpers import autocast_step

from pl_lowprec.transforms import autocast_activations
from pl_lowprec.transforms.autocast_activations import keep_activations_in_compute_dtype
from pl_lowprec.transforms.lora import inject_lora, prepare_for_kbit_training

pytest.importorskip("peft")


def _lora_llama(seed: int = 0):
    """A bf16 Llama with LoRA on every linear layer, adapters and norms upcast to fp32 as under bf16-mixed."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(llama_config(hidden_size=64, layers=2)).to(torch.bfloat16)
    inject_lora(model, {"r": 4, "lora_alpha": 8})
    prepare_for_kbit_training(model, mixed_precision=True)
    torch.manual_seed(1)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)  # peft starts B at zero: give every adapter a gradient
    return model


@pytest.mark.parametrize("row_elements", [1 << 22, 64 * 5])
def test_gradients_equal_with_fewer_saved_bytes_when_only_memory_changes(monkeypatch, row_elements):
    monkeypatch.setattr(autocast_activations, "ROW_ELEMENTS", row_elements)  # small: norms' backward in row groups
    ids = torch.randint(0, 256, (2, 32))
    reference, hooked = _lora_llama(), _lora_llama()
    keep_activations_in_compute_dtype(hooked)
    # the reference casts its norms' outputs too (the one change of numbers, checked on its own below), so that
    # what is left differs only in memory: LoRA's inputs and the norms recomputed in backward
    keep_activations_in_compute_dtype(reference, recompute_norms=False)
    for module in reference.modules():
        if "_cast_input_dtype" in vars(module):
            del module._cast_input_dtype  # peft upcasts LoRA's input to fp32 again
    loss_ref, grads_ref, saved_ref = autocast_step(reference, ids)
    loss, grads, saved = autocast_step(hooked, ids)
    assert set(grads) == set(grads_ref) and len(grads) == 2 * 7 * 2  # A and B of 7 layers in 2 blocks
    torch.testing.assert_close(loss, loss_ref, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, grads_ref[name], rtol=0, atol=0, msg=name)
    assert saved < 0.9 * saved_ref, (saved, saved_ref)  # logits dominate this tiny model; -13% here


def test_norm_outputs_follow_the_input_under_autocast_only():
    model = _lora_llama()
    keep_activations_in_compute_dtype(model)
    norm = model.model.norm
    x = torch.randn(2, 4, 64, dtype=torch.bfloat16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = norm(x)
    outside = norm(x)
    assert norm.weight.dtype == torch.float32
    assert inside.dtype == torch.bfloat16 and outside.dtype == torch.float32
    torch.testing.assert_close(inside, outside.to(torch.bfloat16), rtol=0, atol=0)
    inside.float().sum().backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_hooks_are_applied_once():
    model = _lora_llama()
    first = keep_activations_in_compute_dtype(model)
    assert first == 5 + 2 * 7  # 2 x 2 block norms and the final one; 14 LoRA layers
    assert keep_activations_in_compute_dtype(model) == 0
