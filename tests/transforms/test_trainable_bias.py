"""A bias that trains (LoRA ``bias='lora_only'``) on a bitsandbytes layer stays in its fp32 upcast under mixed
precision: bitsandbytes cast it to bf16 in place on the first forward, silently."""

from __future__ import annotations

import pytest
import torch
from lightning_helpers import quiet_trainer
from loading_helpers import LlamaModule, save_llama
from qlora_helpers import ids_loader

from pl_lowprec import AMPPrecision, LowPrecisionStrategy
from pl_lowprec.transforms.quantization import QuantizationConfig, quantize_linear
from pl_lowprec.transforms.trainable_bias import keep_trainable_biases

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")


ON_GPU = pytest.param("cuda", marks=pytest.mark.cuda)  # bitsandbytes' CUDA kernels


@pytest.mark.parametrize("device", ["cpu", ON_GPU])
@pytest.mark.parametrize("mode", ["nf4", "int8"])
def test_a_bitsandbytes_layer_adds_its_trainable_bias_itself_and_computes_the_same(mode, device):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 64)
    layer = quantize_linear(linear, QuantizationConfig.from_mode(mode), torch.bfloat16, torch.device(device))
    x = torch.randn(3, 64, dtype=torch.bfloat16, device=device)
    with torch.autocast(device, dtype=torch.bfloat16):
        expected = layer(x)  # bitsandbytes' own, bias frozen in bf16 after this
    layer.bias = torch.nn.Parameter(layer.bias.detach().float())
    assert keep_trainable_biases(torch.nn.Sequential(layer)) == ["0"]
    with torch.autocast(device, dtype=torch.bfloat16):
        out = layer(x)
    out.float().sum().backward()
    assert layer.bias.dtype == torch.float32 and layer.bias.grad.dtype == torch.float32
    torch.testing.assert_close(out, expected, rtol=0.02, atol=0.02)  # one bf16 rounding apart
    torch.testing.assert_close(layer.bias.grad, torch.full((64,), 3.0, device=device))


@pytest.mark.parametrize("accelerator", ["cpu", pytest.param("gpu", marks=pytest.mark.cuda)])
def test_biases_trained_under_qlora_and_bf16_mixed_stay_fp32_and_train(tmp_path, accelerator):
    directory = save_llama(tmp_path / "pretrained", attention_bias=True)
    strategy = LowPrecisionStrategy(pretrained=directory, quantization="nf4", lora={"r": 4, "bias": "lora_only"})
    trainer = quiet_trainer(
        accelerator=accelerator, strategy=strategy, plugins=[AMPPrecision("bf16-mixed")], max_steps=2
    )
    with trainer.init_module(empty_init=True):
        model = LlamaModule(attention_bias=True)
    trainer.fit(model, ids_loader(batches=2))
    biases = {n: p for n, p in model.named_parameters() if n.endswith("base_layer.bias")}
    assert len(biases) == 8 and all(p.requires_grad and p.dtype == torch.float32 for p in biases.values())
    from safetensors.torch import load_file

    original = load_file(directory / "model.safetensors")["model.layers.0.self_attn.q_proj.bias"]
    assert not torch.equal(biases["model.model.layers.0.self_attn.q_proj.base_layer.bias"].detach().cpu(), original)
