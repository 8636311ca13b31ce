"""Adapter-only checkpoints: small, resume exactly into a freshly quantized base, export for peft."""

import lightning.pytorch as pl
import pytest
import torch
from lightning_helpers import quiet_trainer
from qlora_helpers import ids_loader, tiny_llama

from pl_lowprec import AMPPrecision, LowPrecisionStrategy
from pl_lowprec.adapters import export_adapter, merged_state_dict

peft = pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

STEPS_PER_EPOCH = 4


def _strategy(**overrides):
    return LowPrecisionStrategy(**{"quantization": "nf4-dq", "lora": {"r": 8, "lora_alpha": 16}, **overrides})


def _fit(epochs, ckpt_path=None, seed=0, amp=True, lr=3e-3, **strategy_overrides):
    torch.manual_seed(seed)
    model = tiny_llama(hidden_size=128, lr=lr)
    _bf16_exact(model.model)
    plugins = [AMPPrecision("bf16-mixed")] if amp else []
    trainer = quiet_trainer(strategy=_strategy(**strategy_overrides), plugins=plugins, max_epochs=epochs)
    trainer.fit(model, ids_loader(batches=STEPS_PER_EPOCH), ckpt_path=ckpt_path)
    return trainer, model


def test_adapter_checkpoint_is_smaller_by_the_base_and_resumes_exactly(tmp_path):
    straight_trainer, straight = _fit(epochs=2)

    first, _ = _fit(epochs=1)
    adapter_ckpt, full_ckpt = tmp_path / "adapter.ckpt", tmp_path / "full.ckpt"
    first.save_checkpoint(adapter_ckpt)
    full_trainer, _ = _fit(epochs=1, adapter_only_checkpoint=False)
    full_trainer.save_checkpoint(full_ckpt)

    saved = torch.load(adapter_ckpt, weights_only=False)["state_dict"]
    assert saved and all("lora_" in k for k in saved)
    full = torch.load(full_ckpt, weights_only=False)["state_dict"]
    base_bytes = sum(v.numel() * v.element_size() for k, v in full.items() if k not in saved and torch.is_tensor(v))
    size_saved = adapter_ckpt.stat().st_size
    assert full_ckpt.stat().st_size - size_saved >= 0.95 * base_bytes  # smaller by the (quantized) base

    # another seed draws other initial adapters: the checkpoint must replace them all
    resumed_trainer, resumed = _fit(epochs=2, ckpt_path=adapter_ckpt, seed=123)
    assert resumed_trainer.global_step == straight_trainer.global_step == 2 * STEPS_PER_EPOCH
    straight_params = dict(straight.named_parameters())
    for name, param in resumed.named_parameters():
        torch.testing.assert_close(param, straight_params[name], rtol=0, atol=0, msg=name)


def test_wrong_checkpoint_fails_clearly(tmp_path):
    trainer, _ = _fit(epochs=1)
    ckpt = tmp_path / "r8.ckpt"
    trainer.save_checkpoint(ckpt)
    with pytest.raises(ValueError, match=r"does not fit the model this config builds: \d+ unexpected keys .*lora="):
        _fit(epochs=2, ckpt_path=ckpt, lora={"r": 8, "target_modules": ["q_proj"]})


def _logits(model, ids, bf16_autocast=True):
    """By default under bf16 autocast, as the model trained: frozen layers compute in bf16 either way."""
    model.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_autocast):
        return model(ids).float()


def _bf16_exact(model):
    """The "pretrained" base as a bf16 checkpoint holds it (its values exact in bf16), which is what pl_lowprec keeps
    of a frozen weight under bf16-mixed."""
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.bfloat16())
    return model


def _assert_same_adapters(trained, reloaded):
    """Every trained LoRA weight is in the peft model, bit for bit."""
    ours = {n.removeprefix("model."): p for n, p in trained.named_parameters() if "lora_" in n}
    theirs = {n.removeprefix("base_model.model."): p for n, p in reloaded.named_parameters() if "lora_" in n}
    assert ours.keys() == theirs.keys() and ours
    for name, param in ours.items():
        torch.testing.assert_close(theirs[name].float(), param.float(), rtol=0, atol=0, msg=name)


def test_exported_adapter_reloads_in_peft_with_the_same_logits(tmp_path):
    _, trained = _fit(epochs=1, quantization=None)  # plain LoRA: the base is exact
    directory = export_adapter(trained, tmp_path / "adapter")
    assert (directory / "adapter_config.json").exists() and (directory / "adapter_model.safetensors").exists()

    base = _bf16_exact(tiny_llama(hidden_size=128).model)  # same init_seed: the same "pretrained" base
    reloaded = peft.PeftModel.from_pretrained(base, str(directory))
    _assert_same_adapters(trained, reloaded)
    ids = ids_loader(batches=1).dataset[0]["input_ids"][None]
    reloaded.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reloaded(input_ids=ids).logits.float()
    # the one difference: pl_lowprec keeps the residual stream in bf16 under autocast, peft's reload in fp32
    torch.testing.assert_close(_logits(trained, ids), expected, rtol=0.02, atol=0.02)


def test_exported_qlora_adapter_reloads_on_a_quantized_base(tmp_path):
    from pl_lowprec.transforms.quantization import QuantizationConfig, quantize_model

    _, trained = _fit(epochs=1)
    directory = export_adapter(trained, tmp_path / "adapter")
    base = _bf16_exact(tiny_llama(hidden_size=128).model)
    quantize_model(base, QuantizationConfig.from_mode("nf4-dq"), torch.bfloat16, torch.device("cpu"))
    base.is_loaded_in_4bit = True  # as transformers marks a bitsandbytes-loaded model, for peft
    reloaded = peft.PeftModel.from_pretrained(base, str(directory))
    assert type(reloaded.base_model.model.model.layers[0].self_attn.q_proj).__module__ == "peft.tuners.lora.bnb"
    _assert_same_adapters(trained, reloaded)
    ids = ids_loader(batches=1).dataset[0]["input_ids"][None]
    reloaded.eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected = reloaded(input_ids=ids).logits.float()
    torch.testing.assert_close(_logits(trained, ids), expected, rtol=0.02, atol=0.02)  # bf16 vs fp32 residual


def test_merged_dequantized_state_dict_loads_into_the_plain_model():
    from pl_lowprec.transforms.quantization import QuantizationConfig

    fp32_compute = QuantizationConfig("nf4-dq", compute_dtype="float32")  # exact comparison, no bf16 rounding
    _, trained = _fit(epochs=1, amp=False, quantization=fp32_compute, lora={"r": 8, "lora_alpha": 16}, lr=3e-2)
    merged = merged_state_dict(trained)
    plain = tiny_llama(hidden_size=128).model
    assert set(merged) == set(plain.state_dict())
    q_proj = trained.model.model.layers[0].self_attn.q_proj
    delta = q_proj.get_delta_weight("default")
    assert delta.abs().max() > 1e-3  # the adapters moved, so a merge that dropped them would show
    plain.load_state_dict(merged)
    ids = ids_loader(batches=1).dataset[0]["input_ids"][None]
    plain.eval()
    with torch.no_grad():
        merged_logits = plain(input_ids=ids).logits.float()
    torch.testing.assert_close(merged_logits, _logits(trained, ids, bf16_autocast=False), atol=1e-4, rtol=1e-4)


class _Classifier(pl.LightningModule):
    """A module of the user's own: a Hugging Face sequence classifier, whose score head is new (random)."""

    def __init__(self):
        super().__init__()
        from loading_helpers import llama_config
        from transformers import LlamaForSequenceClassification

        torch.manual_seed(3)
        self.model = LlamaForSequenceClassification(llama_config(num_labels=2, pad_token_id=0))

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"].clamp(min=1)  # 0 is the padding token
        return self.model(input_ids=ids, labels=(ids[:, 0] % 2)).loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def test_a_classifiers_new_head_trains_with_task_type_and_exports_with_the_adapters(tmp_path):
    """lora task_type='SEQ_CLS' trains the score head whole, as peft's get_peft_model does (it stayed frozen at its
    random init), and the exported adapter holds it: peft reloads the trained classifier exactly."""
    trained = _Classifier()
    head = trained.model.score.weight.detach().clone()
    strategy = LowPrecisionStrategy(lora={"r": 4, "lora_alpha": 8, "task_type": "SEQ_CLS"})
    quiet_trainer(strategy=strategy, max_steps=3).fit(trained, ids_loader(batches=3))
    assert not torch.equal(trained.model.score.modules_to_save["default"].weight, head)

    directory = export_adapter(trained, tmp_path / "adapter")
    reloaded = peft.PeftModel.from_pretrained(_Classifier().model, str(directory))  # the same random base
    ids = ids_loader(batches=1).dataset[0]["input_ids"][None].clamp(min=1)
    trained.eval(), reloaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, trained.model(input_ids=ids).logits)


def test_a_missing_trainable_tensor_is_refused_and_a_frozen_one_beside_it_is_not():
    """Keyed by tensor: a layer whose bias trains (``bias='lora_only'``) and whose weight is frozen loads from a
    checkpoint holding the bias alone; without the bias it is refused, naming it."""
    from pl_lowprec.adapters import CheckpointMismatch, load_trainable_state_dict

    layer = torch.nn.Linear(4, 4)
    layer.weight.requires_grad_(False)
    load_trainable_state_dict(layer, {"bias": torch.ones(4)})
    assert torch.equal(layer.bias.detach(), torch.ones(4))
    with pytest.raises(CheckpointMismatch, match=r"1 missing trainable keys \(e.g. bias\)"):
        load_trainable_state_dict(layer, {})
