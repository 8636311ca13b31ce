"""LoRA options the strategy would not run as peft means them, refused when the strategy is built: the
data-driven inits peft leaves to its caller (EVA and LoRA-GA otherwise train plain LoRA under their names), LoftQ,
the inits that compute from a base weight bitsandbytes has already packed, and the options only peft's
get_peft_model or PeftModel applies."""

from __future__ import annotations

import pytest

from pl_lowprec import LowPrecisionStrategy

pytest.importorskip("peft")


@pytest.mark.parametrize(
    ("init", "quantization", "says"),
    [
        ("eva", None, "peft's initialize_lora_eva_weights"),
        ("lora_ga", None, "peft's preprocess_loraga"),
        ("corda", None, "peft's preprocess_corda"),
        ("loftq", None, "LoftQ quantizes each full-precision weight itself, on a CUDA device"),
        ("eva", "nf4", "plain LoRA under EVA's name"),
        ("pissa", "nf4", "quantization='nf4' has packed the weights"),
        ("pissa_niter_4", "int8", "quantization='int8' has packed the weights"),
        ("mica", "nf4-dq", "PiSSA's and MiCA's SVD"),
        ("orthogonal", "fp4", "orthogonal gives A and B that dtype"),
    ],
)
def test_an_init_the_strategy_would_not_run_is_refused_when_built(init, quantization, says):
    lora = {"r": 4, "init_lora_weights": init} | ({"loftq_config": {"loftq_bits": 4}} if init == "loftq" else {})
    with pytest.raises(ValueError) as refused:
        LowPrecisionStrategy(lora=lora, quantization=quantization)
    message = str(refused.value)
    assert message.startswith(f"lora: init_lora_weights={init!r}") and says in message
    assert "Allowed" in message and "Fix: one of those" in message


@pytest.mark.parametrize(
    ("init", "quantization"),
    [("olora", "nf4"), ("gaussian", "int8"), ("pissa", None), ("pissa_niter_4", None), ("mica", None)],
)
def test_the_inits_it_runs_are_taken(init, quantization):
    strategy = LowPrecisionStrategy(lora={"r": 4, "init_lora_weights": init}, quantization=quantization)
    assert strategy.transform_config.lora.init_lora_weights == init


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("trainable_token_indices", [1, 2], "modules_to_save: [embed_tokens] trains the whole input embedding"),
        ("layer_replication", [[0, 1]], "replicate the layers in your model before training"),
        ("ensure_weight_tying", True, "a head tied to a module trained whole keeps the original rows"),
        ("alora_invocation_tokens", [5, 6], "aLoRA needs peft's PeftModel"),
        ("target_parameters", ["mlp.experts.gate_up_proj"], "name the linear layers in target_modules"),
    ],
)
def test_an_option_only_peft_model_applies_is_refused_when_built(field, value, says):
    """The strategy injects LoRA into the module (peft's inject_adapter_in_model): these were ignored in silence
    (layer_replication, ensure_weight_tying, aLoRA) or failed with a traceback inside peft."""
    with pytest.raises(ValueError) as refused:
        LowPrecisionStrategy(lora={"r": 4, field: value, "modules_to_save": ["embed_tokens"]})
    message = str(refused.value)
    assert message.startswith(f"lora: {field}={value!r} ") and says in message


def test_inference_mode_is_refused_when_built(tmp_path):
    """inference_mode=True (what a LoraConfig read from a saved adapter directory holds) froze every adapter: fit
    stopped at its first step in a traceback instead of a refusal."""
    import peft

    # as PeftModel.save_pretrained and pl_lowprec's export_adapter write an adapter_config.json
    peft.LoraConfig(r=4, target_modules=["q_proj"], inference_mode=True).save_pretrained(str(tmp_path))
    saved = peft.LoraConfig.from_pretrained(str(tmp_path))
    assert saved.inference_mode
    for lora in (saved, {"r": 4, "inference_mode": True}):
        with pytest.raises(ValueError, match=r"inference_mode=True freezes the adapters.*Fix: inference_mode: false"):
            LowPrecisionStrategy(lora=lora)
    LowPrecisionStrategy(lora={"r": 4, "inference_mode": False})
