"""QLoRA by configuration on a tiny Llama (CPU): trains, leaves the base untouched, survives validation passes."""

import math

import lightning.pytorch as pl
import pytest
import torch
from lightning_helpers import quiet_trainer
from qlora_helpers import GradRecorder, LossRecorder, frozen_state, ids_loader, tiny_llama

from pl_lowprec import AMPPrecision, LowPrecisionStrategy
from pl_lowprec.checkpointing import is_checkpointed
from pl_lowprec.memory.breakdown import parameter_bytes

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")


def qlora_strategy(**overrides):
    settings = dict(
        quantization="nf4-dq", lora={"r": 8, "lora_alpha": 16}, activation_checkpointing="LlamaDecoderLayer"
    )
    return LowPrecisionStrategy(**{**settings, **overrides})


class BaseSnapshot(pl.Callback):
    def on_train_start(self, trainer, pl_module):
        self.before = frozen_state(pl_module)
        self.lora_before = {n: p.clone() for n, p in pl_module.named_parameters() if p.requires_grad}


def test_qlora_bf16_trains_only_the_adapters_after_sanity_check_and_validation():
    snapshot, losses = BaseSnapshot(), LossRecorder()
    model = tiny_llama(lr=1e-2)
    trainer = quiet_trainer(
        strategy=qlora_strategy(),
        plugins=[AMPPrecision("bf16-mixed")],
        max_steps=30,
        val_check_interval=10,
        limit_val_batches=2,
        num_sanity_val_steps=2,
        callbacks=[snapshot, losses],
    )
    trainer.fit(model, ids_loader(batches=30), ids_loader(batches=2, seed=1))

    assert trainer.sanity_checking is False and "val/perplexity" in trainer.callback_metrics
    first, last = sum(losses.losses[:5]) / 5, sum(losses.losses[-5:]) / 5
    assert last < first - 0.5, (first, last)  # nats; the base is random, so LoRA learns slowly
    after = frozen_state(model)
    assert after.keys() == snapshot.before.keys() and len(after) > 20
    for key, value in snapshot.before.items():
        assert torch.equal(after[key], value), f"frozen {key} changed"
    trainable = dict(model.named_parameters())
    assert all("lora_" in n for n in snapshot.lora_before)
    assert all(not torch.equal(trainable[n], v) for n, v in snapshot.lora_before.items() if "lora_B" in n)
    layers = model.model.model.layers
    assert all(is_checkpointed(layer) for layer in layers)
    assert type(layers[0].self_attn.q_proj).__module__ == "peft.tuners.lora.bnb"  # peft's bnb-aware LoRA


def _one_step_grads(validate_first: bool):
    torch.manual_seed(0)  # LoRA's A matrices are drawn from the global generator at injection
    recorder = GradRecorder()
    model = tiny_llama()
    trainer = quiet_trainer(
        strategy=qlora_strategy(),
        plugins=[AMPPrecision("bf16-mixed")],
        max_steps=1,
        callbacks=[recorder],
        num_sanity_val_steps=2 if validate_first else 0,
        limit_val_batches=2,
    )
    if validate_first:
        trainer.validate(model, ids_loader(batches=2, seed=1))
    trainer.fit(model, ids_loader(), ids_loader(batches=2, seed=1) if validate_first else None)
    return recorder.grads[0]


def test_lora_gradients_after_validation_equal_those_without():
    # On CPUs with avx512_bf16 an eval pass repacks 4-bit weights; training after it must be unaffected.
    validated, fresh = _one_step_grads(True), _one_step_grads(False)
    assert validated.keys() == fresh.keys() and validated
    for name, grad in fresh.items():
        torch.testing.assert_close(validated[name], grad)


def test_quantized_weights_take_at_most_0_52_bytes_per_parameter():
    model = tiny_llama(hidden_size=128)
    quantized_params = sum(
        m.weight.numel() for n, m in model.named_modules() if type(m) is torch.nn.Linear and not n.endswith("lm_head")
    )
    quiet_trainer(strategy=qlora_strategy(), max_steps=1).fit(model, ids_loader(batches=1))
    nbytes = parameter_bytes(model)["quantized_4bit"]  # packed weights + absmax + nested constants + code books
    assert nbytes / quantized_params <= 0.52, nbytes / quantized_params


def test_fp16_qlora_keeps_the_scale_live():
    plugin = AMPPrecision("16-mixed")
    losses = LossRecorder()
    model = tiny_llama()
    trainer = quiet_trainer(strategy=qlora_strategy(), plugins=[plugin], max_steps=8, callbacks=[losses])
    trainer.fit(model, ids_loader())
    assert plugin.scaler is not None and plugin.loss_scale_state().scale >= 1.0
    assert all(math.isfinite(x) for x in losses.losses)
    adapters = [p for n, p in model.named_parameters() if "lora_" in n]
    assert adapters and all(p.dtype == torch.float32 for p in adapters)  # fp32 adapters, fp16 compute
    assert model.model.model.layers[0].self_attn.q_proj.base_layer.compute_dtype == torch.float16


@pytest.mark.parametrize(
    ("plugins", "precision", "adapter_dtype"),
    [
        ([AMPPrecision("bf16-mixed")], None, torch.float32),
        ([], "bf16-true", torch.bfloat16),
        ([], "32-true", torch.float32),
    ],
)
def test_combines_with_precisions(plugins, precision, adapter_dtype):
    model = tiny_llama()
    kwargs = {"precision": precision} if precision else {}
    losses = LossRecorder()
    trainer = quiet_trainer(strategy=qlora_strategy(), plugins=plugins, max_steps=3, callbacks=[losses], **kwargs)
    trainer.fit(model, ids_loader())
    assert trainer.global_step == 3 and all(math.isfinite(x) for x in losses.losses)
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {adapter_dtype}


@pytest.mark.parametrize("mode", ["nf4", "fp4", "fp4-dq", "int8"])
def test_every_mode_trains(mode):
    model = tiny_llama()
    losses = LossRecorder()
    trainer = quiet_trainer(
        strategy=qlora_strategy(quantization=mode),
        plugins=[AMPPrecision("bf16-mixed")],
        max_steps=2,
        callbacks=[losses],
    )
    trainer.fit(model, ids_loader())
    assert all(math.isfinite(x) for x in losses.losses)
    kind = "quantized_8bit" if mode == "int8" else "quantized_4bit"
    assert kind in parameter_bytes(model)


def test_plain_lora_without_quantization():
    model = tiny_llama()
    frozen_before = model.model.model.layers[0].mlp.up_proj.weight.detach().clone()
    trainer = quiet_trainer(strategy=LowPrecisionStrategy(lora={"r": 4}), max_steps=3)
    trainer.fit(model, ids_loader())
    layer = model.model.model.layers[0].mlp.up_proj
    assert type(layer).__module__ == "peft.tuners.lora.layer"
    assert torch.equal(layer.base_layer.weight, frozen_before)
    assert not model.model.lm_head.weight.requires_grad  # all-linear leaves the output head out
