"""Bad QLoRA input fails before the first training step, naming the value and the fix."""

from unittest import mock

import pytest
import torch
from lightning_helpers import Classifier, quiet_trainer
from plain_amp_loop import make_classification_data
from qlora_helpers import ids_loader, tiny_llama
from torch import nn

from pl_lowprec import LowPrecisionStrategy
from pl_lowprec import _imports as imports
from pl_lowprec.transforms.quantization import _INT8_OK, QuantizationConfig

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")


def test_unknown_mode_lists_the_allowed_ones():
    with pytest.raises(ValueError, match=r"mode 'nf8' is not supported. Allowed: 'nf4', 'nf4-dq', 'fp4', 'fp4-dq'"):
        LowPrecisionStrategy(quantization="nf8")


def test_bad_dtype_name():
    with pytest.raises(ValueError, match=r"'bf16' is not a torch dtype; use a name such as 'bfloat16'"):
        QuantizationConfig("nf4", compute_dtype="bf16")


def test_model_without_linear_layers():
    model = Classifier(nn.Sequential(nn.Unflatten(1, (1, 32)), nn.Conv1d(1, 4, 32), nn.Flatten()))
    trainer = quiet_trainer(strategy=LowPrecisionStrategy(quantization="nf4"), max_steps=1)
    with pytest.raises(ValueError, match=r"quantization='nf4' found no nn.Linear to quantize in Classifier"):
        trainer.fit(model, torch.utils.data.DataLoader(make_classification_data(n=8), batch_size=4))
    assert trainer.global_step == 0


def test_every_linear_skipped():
    model = Classifier(nn.Sequential(nn.Linear(32, 4)))
    config = QuantizationConfig("nf4", skip_modules=["model.*"])
    trainer = quiet_trainer(strategy=LowPrecisionStrategy(quantization=config), max_steps=1)
    with pytest.raises(ValueError, match=r"every linear layer matches skip_modules=\['model.\*'\] \(model.0\)"):
        trainer.fit(model, torch.utils.data.DataLoader(make_classification_data(n=8), batch_size=4))


def test_lora_targets_that_match_nothing_list_the_linear_layers():
    trainer = quiet_trainer(strategy=LowPrecisionStrategy(lora={"r": 4, "target_modules": ["query"]}), max_steps=1)
    with pytest.raises(
        ValueError,
        match=r"target_modules=\['query'\] matches no linear layer of TinyLlama.*"
        r"model.model.layers.0.self_attn.q_proj, .*model.lm_head",
    ):
        trainer.fit(tiny_llama(), ids_loader())
    assert trainer.global_step == 0


@pytest.mark.parametrize("target", [["embed_tokens", "q_proj"], r".*\.(embed_tokens|q_proj)"])
def test_lora_targets_naming_an_embedding_are_refused_not_dropped(target):
    """peft's get_peft_model adapts an nn.Embedding named in target_modules (lora.Embedding); the strategy adapts
    linear layers only and left it out in silence: LoRA on the q_proj layers alone, fewer adapters than peft's."""
    trainer = quiet_trainer(strategy=LowPrecisionStrategy(lora={"r": 4, "target_modules": target}), max_steps=1)
    with pytest.raises(
        ValueError,
        match=r"target_modules names model.model.embed_tokens \(Embedding\).*linear layers only.*modules_to_save",
    ):
        trainer.fit(tiny_llama(), ids_loader())
    assert trainer.global_step == 0


def test_invalid_lora_field():
    with pytest.raises(ValueError, match=r"lora=\{'rank': 8\} is not a valid peft.LoraConfig"):
        LowPrecisionStrategy(lora={"rank": 8})


@pytest.mark.parametrize(
    ("cache", "importer", "kwargs", "hint"),
    [
        ("_BITSANDBYTES", "import_bitsandbytes", {"quantization": "nf4"}, "quantization= and the 8-bit optimizers"),
        ("_BITSANDBYTES", "import_bitsandbytes", {"optimizer": "adamw8bit"}, "quantization= and the 8-bit optimizers"),
        ("_PEFT", "import_peft", {"lora": {"r": 4}}, "lora= needs peft"),
    ],
)
def test_missing_optional_dependency_gives_the_install_command(cache, importer, kwargs, hint):
    missing = mock.MagicMock(__bool__=lambda self: False, message="'x' is not installed")
    getattr(imports, importer).cache_clear()
    try:
        with mock.patch.object(imports, cache, missing), pytest.raises(ModuleNotFoundError) as err:
            LowPrecisionStrategy(**kwargs)
    finally:
        getattr(imports, importer).cache_clear()
    assert hint in str(err.value) and 'pip install "pl_lowprec[qlora]"' in str(err.value)


def test_int8_on_a_device_bitsandbytes_cannot_train_on():
    import bitsandbytes

    _INT8_OK.clear()
    broken = mock.patch.object(bitsandbytes, "matmul", side_effect=NotImplementedError("no int8 kernel for cpu"))
    trainer = quiet_trainer(strategy=LowPrecisionStrategy(quantization="int8", lora={"r": 4}), max_steps=1)
    try:
        with (
            broken,
            pytest.raises(
                ValueError,
                match=r"quantization='int8' cannot train on cpu.*no int8 kernel"
                r".*Modes that can run here: 'nf4', 'nf4-dq', 'fp4', 'fp4-dq'",
            ),
        ):
            trainer.fit(tiny_llama(), ids_loader())
    finally:
        _INT8_OK.clear()
    assert trainer.global_step == 0


def test_layers_to_transform_with_the_default_targets_names_the_fix():
    with pytest.raises(ValueError, match=r"left at this package's default, 'all-linear' \(a string\): name the layers"):
        LowPrecisionStrategy(lora={"r": 4, "layers_to_transform": [1]})


def test_layers_to_transform_adapts_only_those_blocks_and_exports_them():
    """peft's ``layers_to_transform`` with named targets: LoRA on block 1 only, as ``get_peft_model`` picks it (the
    injection names its targets by a regular expression, which peft does not combine with layer indexes)."""
    from pl_lowprec.transforms.lora import inject_lora, lora_layers

    model = tiny_llama()
    inject_lora(model, {"r": 4, "target_modules": ["q_proj", "v_proj"], "layers_to_transform": [1]})
    assert sorted(lora_layers(model)) == [
        "model.model.layers.1.self_attn.q_proj",
        "model.model.layers.1.self_attn.v_proj",
    ]
    with pytest.raises(ValueError, match=r"layers_to_transform=\[7\] .* keep none of the 4 target layers"):
        inject_lora(tiny_llama(), {"r": 4, "target_modules": ["q_proj", "v_proj"], "layers_to_transform": [7]})


def test_excluded_modules_are_left_out_of_the_targets_and_of_the_count():
    from pl_lowprec.transforms.lora import inject_lora, lora_layers

    model = tiny_llama()
    targets = inject_lora(model, {"r": 4, "exclude_modules": ["down_proj"]})
    assert sorted(targets) == sorted(lora_layers(model)) and len(targets) == 12  # 14 linear layers, 2 down_proj
    assert not any(name.endswith("down_proj") for name in targets)


@pytest.mark.parametrize("pattern", ["lm_head", "*lm_head", "model.lm_head"])
def test_a_head_named_by_its_last_part_stays_unquantized_and_without_lora(pattern):
    """The shipped configs wrote ``skip_modules: [lm_head]`` while the head is ``model.lm_head``: the pattern
    matched nothing and replaced the default, so the head was quantized and given an adapter. Patterns now match
    a name's last dotted parts, as peft's ``target_modules`` do."""
    model = tiny_llama()
    strategy = LowPrecisionStrategy(quantization=QuantizationConfig("nf4", skip_modules=[pattern]), lora={"r": 4})
    quiet_trainer(strategy=strategy, max_steps=1).fit(model, ids_loader(batches=1))
    assert type(model.model.lm_head) is nn.Linear
    import bitsandbytes as bnb

    quantized = [n for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    adapted = [n for n, m in model.named_modules() if hasattr(m, "lora_A")]
    assert len(quantized) == len(adapted) == 14  # 2 layers x 7 projections
    assert not any("lm_head" in n for n in quantized + adapted)


def test_a_skip_pattern_that_names_no_layer_is_refused_before_the_first_step():
    trainer = quiet_trainer(
        strategy=LowPrecisionStrategy(quantization=QuantizationConfig("nf4", skip_modules=["lmhead"]), lora={"r": 4}),
        max_steps=1,
    )
    with pytest.raises(
        ValueError,
        match=r"QuantizationConfig\(skip_modules=\['lmhead'\]\): 'lmhead' names no linear layer of TinyLlama, so it"
        r" keeps nothing out .*'lm_head' matches 'model.lm_head'. The linear layers are"
        r" model.model.layers.0.self_attn.q_proj, .*model.lm_head. Correct the pattern",
    ):
        trainer.fit(tiny_llama(), ids_loader(batches=1))
    assert trainer.global_step == 0


def test_all_linear_under_a_users_skip_modules_says_where_it_differs_from_peft(caplog):
    """Under quantization skip_modules=['model.model.layers.0.mlp.down_proj'] (a layer kept 16-bit, as transformers'
    llm_int8_skip_modules), all-linear left that layer without LoRA and adapted the quantized lm_head; peft's
    all-linear does the opposite of both. The LoRA line gave only a count."""
    import logging

    config = QuantizationConfig("nf4", skip_modules=["*.layers.0.mlp.down_proj"])
    trainer = quiet_trainer(strategy=LowPrecisionStrategy(quantization=config, lora={"r": 4}), max_steps=1)
    with caplog.at_level(logging.INFO):
        trainer.fit(tiny_llama(), ids_loader(batches=1))
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("LoRA on"))
    assert "leaves out the 1 layers skip_modules keeps unquantized (model.model.layers.0.mlp.down_proj)" in line
    assert "adapts the output heads model.lm_head" in line and "peft's all-linear adapts every linear layer" in line


@pytest.mark.parametrize("mode", ["nf4", "int8"])
def test_modules_to_save_naming_a_quantized_layer_is_refused(mode):
    """modules_to_save: [down_proj] under quantization stopped in a traceback inside peft or bitsandbytes ("only
    Tensors of floating point dtype can require gradients"): the layer's weights are packed integers."""
    lora = {"r": 4, "modules_to_save": ["down_proj"]}
    trainer = quiet_trainer(strategy=LowPrecisionStrategy(quantization=mode, lora=lora), max_steps=1)
    with pytest.raises(
        ValueError, match=r"modules_to_save names model.model.layers.0.mlp.down_proj, .*Fix: add it to quantization's"
    ):
        trainer.fit(tiny_llama(), ids_loader(batches=1))
    assert trainer.global_step == 0
