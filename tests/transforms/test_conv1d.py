"""GPT-2's ``Conv1D`` layers (transformers' linear layer with its weight stored ``[in, out]``) taken as
``nn.Linear``: quantization and LoRA's ``all-linear`` found no linear layer in GPT-2 and the fit was refused after
the weights loaded. The converted model computes what GPT-2 does, its weights load transposed from the checkpoint,
and the exports write them back in Conv1D's layout, so transformers and peft load them as before."""

from __future__ import annotations

import copy
import json

import lightning.pytorch as pl
import pytest
import torch
from lightning_helpers import quiet_trainer
from qlora_helpers import ids_loader

from pl_lowprec import LowPrecisionStrategy
from pl_lowprec.transforms.conv1d import linear_from_conv1d

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

IDS = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))


def gpt2(seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=2, n_head=4)
    return transformers.GPT2LMHeadModel(config)


class GPT2Module(pl.LightningModule):
    """A module of the user's own holding GPT-2."""

    def __init__(self) -> None:
        super().__init__()
        self.model = gpt2()

    def training_step(self, batch, batch_idx):
        return self.model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def _logits(model):
    model.eval()
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_the_converted_model_computes_what_gpt2_does():
    model = gpt2()
    converted = copy.deepcopy(model)
    names = linear_from_conv1d(converted)
    assert names == [
        f"transformer.h.{i}.{layer}"
        for i in range(2)
        for layer in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")
    ]
    assert all(type(converted.get_submodule(n)) is torch.nn.Linear for n in names)
    torch.testing.assert_close(_logits(converted), _logits(model), rtol=1e-5, atol=1e-5)
    assert linear_from_conv1d(converted) == []  # idempotent


@pytest.mark.parametrize(
    ("quantization", "accelerator"),
    [(None, "cpu"), ("nf4", "cpu"), pytest.param("nf4", "gpu", marks=pytest.mark.cuda)],  # bitsandbytes' CUDA kernels
)
def test_gpt2_trains_and_exports_in_conv1ds_layout(quantization, accelerator, tmp_path):
    from transformers import AutoModelForCausalLM

    from pl_lowprec.adapters import export_adapter, merged_state_dict
    from pl_lowprec.export.merged import merge_into_pretrained
    from pl_lowprec.loading import PretrainedWeights

    directory = tmp_path / "gpt2"
    gpt2(seed=1).save_pretrained(directory)
    strategy = LowPrecisionStrategy(pretrained=directory, quantization=quantization, lora={"r": 4})
    trainer = quiet_trainer(accelerator=accelerator, strategy=strategy, max_steps=3)
    with trainer.init_module(empty_init=True):
        module = GPT2Module()
    trainer.fit(module, ids_loader(batches=3))
    module.cpu()  # Lightning's teardown moves it back; the exports and references below run on the CPU
    c_attn = module.model.transformer.h[0].attn.c_attn
    assert c_attn.lora_A["default"].weight.requires_grad  # LoRA on the converted layer (all-linear found it)
    original = AutoModelForCausalLM.from_pretrained(directory)

    adapter = export_adapter(module, tmp_path / "adapter")
    assert json.loads((adapter / "adapter_config.json").read_text())["fan_in_fan_out"] is True
    reloaded = _logits(peft.PeftModel.from_pretrained(original, str(adapter)))
    assert (reloaded - _logits(AutoModelForCausalLM.from_pretrained(directory))).abs().max() > 1e-3  # it trained
    out = tmp_path / "merged"
    out.mkdir()
    merge_into_pretrained(module, PretrainedWeights(directory, prefix="model."), out)
    torch.testing.assert_close(_logits(AutoModelForCausalLM.from_pretrained(out)), reloaded, rtol=1e-4, atol=1e-4)
    plain = gpt2()
    plain.load_state_dict(merged_state_dict(module))
    if quantization is None:  # the trained model itself; with nf4, the merge is onto the original weights
        torch.testing.assert_close(_logits(module.model), reloaded, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(_logits(plain), reloaded, rtol=1e-4, atol=1e-4)
    else:
        assert type(c_attn.base_layer).__name__ == "Linear4bit"
