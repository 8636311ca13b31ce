"""Biases that train beside LoRA: the layers' own (``bias: lora_only`` or ``all``) and B's (``lora_bias: true``).

The adapter directory holds them under the names peft saves them by, so peft reloads the trained model (they were
left out, and peft ran the original biases); a merge adds B's bias, scaled as peft's merge adds it, to the layer's
bias as trained (it was dropped), and is refused where the layer has no bias to hold it.
"""

from __future__ import annotations

import pytest
import torch
from lightning_helpers import quiet_trainer
from loading_helpers import LlamaModule, llama_config, save_llama
from qlora_helpers import ids_loader

from pl_lowprec import LowPrecisionStrategy
from pl_lowprec.adapters import export_adapter, merged_state_dict
from pl_lowprec.export.merged import merge_into_pretrained
from pl_lowprec.loading import PretrainedWeights

peft = pytest.importorskip("peft")

IDS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))


def _fit(tmp_path, lora):
    """A Llama with q/k/v/o biases (as Qwen2 has q/k/v), fine-tuned 3 steps in fp32 from its saved checkpoint."""
    directory = save_llama(tmp_path / "pretrained", attention_bias=True)
    trainer = quiet_trainer(strategy=LowPrecisionStrategy(pretrained=directory, lora=lora), max_steps=3)
    with trainer.init_module(empty_init=True):
        model = LlamaModule(attention_bias=True)
    trainer.fit(model, ids_loader(batches=3))
    return directory, model


def _logits(model):
    model.eval()
    with torch.no_grad():
        return model(input_ids=IDS).logits


def _reloaded_adapter(directory, model, tmp_path):
    from transformers import AutoModelForCausalLM

    adapter = export_adapter(model, tmp_path / "adapter")
    return peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(directory), str(adapter))


@pytest.mark.parametrize("bias", ["lora_only", "all"])
def test_trained_biases_reload_from_the_adapter_and_merge(bias, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    lora = {"r": 4, "target_modules": ["q_proj", "v_proj"], "bias": bias, "lora_bias": True}
    directory, model = _fit(tmp_path, lora)
    q_proj = model.model.model.layers[0].self_attn.q_proj
    original = load_file(directory / "model.safetensors")["model.layers.0.self_attn.q_proj.bias"]
    assert not torch.equal(q_proj.base_layer.bias.detach(), original)  # the layer's bias trained
    assert q_proj.lora_B["default"].bias.detach().abs().max() > 1e-3  # and B's
    trained = _logits(model.model)

    torch.testing.assert_close(_logits(_reloaded_adapter(directory, model, tmp_path)), trained)
    out = tmp_path / "merged"
    out.mkdir()
    merge_into_pretrained(model, PretrainedWeights(directory, prefix="model."), out)
    torch.testing.assert_close(_logits(AutoModelForCausalLM.from_pretrained(out)), trained, rtol=1e-4, atol=1e-4)
    plain = LlamaForCausalLM(llama_config(attention_bias=True))
    plain.load_state_dict(merged_state_dict(model))
    torch.testing.assert_close(_logits(plain), trained, rtol=1e-4, atol=1e-4)


def test_a_merge_of_bs_bias_on_layers_without_one_is_refused(tmp_path):
    directory, model = _fit(tmp_path, {"r": 4, "lora_bias": True})  # all-linear: the MLP's layers have no bias
    refusal = r"lora_bias=True trained a bias beside B on 6 layers whose base layer has no bias \(e.g. model\."
    out = tmp_path / "merged"
    out.mkdir()
    with pytest.raises(ValueError, match=refusal):
        merge_into_pretrained(model, PretrainedWeights(directory, prefix="model."), out)
    assert not any(out.iterdir())
    with pytest.raises(ValueError, match=refusal):
        merged_state_dict(model)
    torch.testing.assert_close(_logits(_reloaded_adapter(directory, model, tmp_path)), _logits(model.model))
