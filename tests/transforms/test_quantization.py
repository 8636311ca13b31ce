"""QLoRA by configuration on a tiny Llama (CPU): trains, leaves the base untouched, survives validation passes."""

import math

import lightning.pytorch as pl
import pytest
import torch
from lightning_helpers import quiet_trainer
from qlora_helpers import GradRecorder, LossRecorder, frozen_state, ids_loader, tiny_llama

from pl_lowprec import AMPPrecision, LowPrecisionStrategy
from pl_lowprec.memory.breakdown import parameter_bytes
from pl_lowprec.transforms.checkpointing import is_checkpointed
from pl_lowprec.transforms.quantization import QuantizationConfig, quantize_linear

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


def _bitsandbytes_repacks_in_eval() -> bool:
    from bitsandbytes.functional import has_avx512bf16

    return bool(has_avx512bf16())


@pytest.mark.skipif(
    not _bitsandbytes_repacks_in_eval(),
    reason="meaningful only on CPUs with avx512_bf16: only there does an eval forward of bitsandbytes repack"
    " 4-bit weights, so elsewhere this test would pass whatever the code does",
)
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


def _assert_learns(losses: LossRecorder, snapshot: BaseSnapshot, model: pl.LightningModule) -> None:
    """The loss on the repeated batch fell, and every trainable parameter (every LoRA A and B) moved."""
    assert all(math.isfinite(x) for x in losses.losses), losses.losses
    assert losses.losses[-1] < losses.losses[0] - 0.2, losses.losses  # nats, on the same batch every step
    trainable = dict(model.named_parameters())
    assert snapshot.lora_before and all("lora_" in n for n in snapshot.lora_before)
    unmoved = [n for n, before in snapshot.lora_before.items() if torch.equal(trainable[n], before)]
    assert not unmoved, unmoved


def test_fp16_qlora_keeps_the_scale_live():
    plugin = AMPPrecision("16-mixed")
    losses, snapshot = LossRecorder(), BaseSnapshot()
    model = tiny_llama(lr=1e-2)
    steps = 8
    trainer = quiet_trainer(strategy=qlora_strategy(), plugins=[plugin], max_steps=steps, callbacks=[losses, snapshot])
    trainer.fit(model, ids_loader(batches=1))  # the same batch every step
    state = plugin.loss_scale_state()
    assert plugin.scaler is not None and state.scale >= 1.0
    # A scale that only survives because every step overflowed and was skipped is not live.
    assert state.skipped_steps <= steps // 4, state
    _assert_learns(losses, snapshot, model)
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
    model = tiny_llama(lr=1e-2)
    kwargs = {"precision": precision} if precision else {}
    losses, snapshot = LossRecorder(), BaseSnapshot()
    trainer = quiet_trainer(
        strategy=qlora_strategy(), plugins=plugins, max_steps=4, callbacks=[losses, snapshot], **kwargs
    )
    trainer.fit(model, ids_loader(batches=1))  # the same batch every step
    assert trainer.global_step == 4
    _assert_learns(losses, snapshot, model)
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {adapter_dtype}


@pytest.mark.parametrize("mode", ["nf4", "fp4", "fp4-dq", "int8"])
def test_every_mode_trains(mode):
    model = tiny_llama(lr=1e-2)
    losses, snapshot = LossRecorder(), BaseSnapshot()
    trainer = quiet_trainer(
        strategy=qlora_strategy(quantization=mode), max_steps=4, callbacks=[losses, snapshot], precision="32-true"
    )
    trainer.fit(model, ids_loader(batches=1))  # the same batch every step
    _assert_learns(losses, snapshot, model)
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


def test_4bit_weights_dequantize_to_the_compute_dtype():
    """An fp32 weight under a bf16 compute dtype is quantized from bf16: the matmul's dequantized copy is bf16 (half
    the bytes), and for a bf16 checkpoint's weights (exact in bf16) the packed weight and constants are the same."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 64, bias=False)
    linear.weight.data = linear.weight.data.bfloat16().float()  # a bf16 checkpoint built into an fp32 module
    config = QuantizationConfig.from_mode("nf4-dq")
    cpu = torch.device("cpu")
    from_fp32 = quantize_linear(linear, config, torch.bfloat16, cpu)
    as_bf16 = torch.nn.Linear(128, 64, bias=False)
    as_bf16.weight.data = linear.weight.data.bfloat16()
    from_bf16 = quantize_linear(as_bf16, config, torch.bfloat16, cpu)
    assert from_fp32.weight.quant_state.dtype == torch.bfloat16
    assert torch.equal(from_fp32.weight.data, from_bf16.weight.data)
    assert torch.equal(from_fp32.weight.quant_state.absmax, from_bf16.weight.quant_state.absmax)
    assert quantize_linear(linear, config, torch.float32, cpu).weight.quant_state.dtype == torch.float32  # 32-true


def test_int8_self_test_leaves_the_global_random_state_alone():
    """The int8 check drew its test tensors from the global RNG, once per process: with the same seed, LoRA's A
    after int8 quantization differed from peft's (get_peft_model on BitsAndBytesConfig(load_in_8bit=True)) and
    between the first and a second fit in one process."""
    from pl_lowprec.transforms import quantization

    bnb = pytest.importorskip("bitsandbytes")
    quantization._INT8_OK.clear()
    torch.manual_seed(0)
    before = torch.get_rng_state()
    quantization.check_int8_trains(bnb, torch.device("cpu"))
    assert quantization._INT8_OK["cpu"]
    assert torch.equal(torch.get_rng_state(), before)


def test_int8_layers_keep_llm_int8_outliers_in_16_bit_as_transformers_does():
    """quantization='int8' built bitsandbytes' Linear8bitLt with its default threshold 0.0: every input feature in
    int8, where transformers' BitsAndBytesConfig(load_in_8bit=True) and Lightning's int8 layers use LLM.int8's
    outlier threshold 6.0. Compared with the layer transformers builds (same weight, same input with an outlier
    feature). Compared in eval mode: in training, bitsandbytes' CPU backend multiplies with the dequantized weight
    (``MatMul8bitFp``), where the threshold plays no part; CUDA, and CPU inference, run LLM.int8's kernel."""
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(0)
    linear = torch.nn.Linear(128, 64)
    x = torch.randn(3, 128)
    x[:, 5] = 40.0  # an outlier feature, as large models' activations have
    ours = quantize_linear(linear, QuantizationConfig.from_mode("int8"), torch.float32, torch.device("cpu"))
    theirs = bnb.nn.Linear8bitLt(
        128, 64, has_fp16_weights=False, threshold=6.0
    )  # transformers' replace_with_bnb_linear
    theirs.weight = bnb.nn.Int8Params(linear.weight.data.clone(), requires_grad=False, has_fp16_weights=False)
    theirs.bias = torch.nn.Parameter(linear.bias.data.clone(), requires_grad=False)
    theirs = theirs.to("cpu").eval()
    ours.eval()
    assert ours.state.threshold == 6.0
    torch.testing.assert_close(ours(x), theirs(x), rtol=0, atol=0)
    exact = linear(x)
    every_feature_int8 = quantize_linear(
        linear, QuantizationConfig("int8", int8_threshold=0.0), torch.float32, torch.device("cpu")
    ).eval()
    assert (ours(x) - exact).abs().max() < (every_feature_int8(x) - exact).abs().max() / 2


@pytest.mark.parametrize("threshold", [-1.0, "6", True])
def test_int8_threshold_is_refused_unless_a_number_at_least_0(threshold):
    with pytest.raises(ValueError, match=r"int8_threshold=.*number >= 0"):
        QuantizationConfig("int8", int8_threshold=threshold)
