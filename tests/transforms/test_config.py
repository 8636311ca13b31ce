"""``TransformConfig``: one frozen, validated value for the model arguments, taken by every strategy,
``ModelTransform`` and ``estimate_memory``."""

import dataclasses
import functools

import pytest
import torch
from torch import nn

from pl_lowprec import LowPrecisionDDPStrategy, LowPrecisionFSDPStrategy, LowPrecisionStrategy
from pl_lowprec.demo import TinyLlama
from pl_lowprec.memory.estimate import estimate_memory
from pl_lowprec.transforms.config import TransformConfig
from pl_lowprec.transforms.linear_filter import DEFAULT_SKIP, is_target_linear
from pl_lowprec.transforms.qat import QATConfig
from pl_lowprec.transforms.quantization import QuantizationConfig


def test_short_names_become_configs_and_the_config_is_frozen():
    config = TransformConfig(
        quantization="nf4-dq", lora={"r": 4}, activation_checkpointing="Block", checkpoint_every_n=2
    )
    assert config.quantization == QuantizationConfig("nf4-dq")
    assert config.lora.r == 4 and config.lora.target_modules == "all-linear"
    assert config.adapter_only and config.skip_modules == DEFAULT_SKIP
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.quantization = None


@pytest.mark.parametrize("strategy", [LowPrecisionStrategy, LowPrecisionDDPStrategy, LowPrecisionFSDPStrategy])
def test_every_strategy_holds_the_config_its_transform_applies(strategy):
    qat = "int8-weight-only" if strategy is not LowPrecisionFSDPStrategy else None
    built = strategy(qat=qat, activation_checkpointing="Block", checkpoint_every_n=3)
    assert built.transform.config is built.transform_config
    assert built.transform_config.checkpoint_every_n == 3


def test_bad_values_are_refused_by_the_config_with_the_same_message_as_the_strategy():
    with pytest.raises(ValueError, match="qat= cannot be combined") as from_config:
        TransformConfig(quantization="nf4", qat="int8-weight-only")
    with pytest.raises(ValueError, match="qat= cannot be combined") as from_strategy:
        LowPrecisionStrategy(quantization="nf4", qat="int8-weight-only")
    assert str(from_config.value) == str(from_strategy.value)


def test_estimate_takes_the_strategy_config_or_the_same_arguments():
    build = functools.partial(TinyLlama, hidden_size=64, intermediate_size=192)
    batch = {"input_ids": torch.zeros(2, 17, dtype=torch.long)}
    arguments = {"lora": {"r": 8}, "activation_checkpointing": ["LlamaDecoderLayer"], "qat": "int8-weight-only"}
    strategy = LowPrecisionStrategy(**arguments)
    from_config = estimate_memory(build, batch, precision="32-true", device="cpu", config=strategy.transform_config)
    from_arguments = estimate_memory(build, batch, precision="32-true", **arguments)
    plain = estimate_memory(build, batch, precision="32-true")
    assert from_config.as_dict() == from_arguments.as_dict()
    assert from_config.trainable_parameters < plain.trainable_parameters  # LoRA froze the base
    with pytest.raises(TypeError, match="config= and the model arguments lora"):
        estimate_memory(build, batch, config=strategy.transform_config, lora={"r": 8})


def test_one_linear_filter_decides_for_every_transform():
    head, out_proj = nn.Linear(2, 2), nn.MultiheadAttention(4, 1).out_proj
    assert is_target_linear(nn.Linear(2, 2), "blocks.0.fc", DEFAULT_SKIP)
    assert not is_target_linear(head, "model.lm_head", DEFAULT_SKIP)
    assert not is_target_linear(out_proj, "attn.out_proj", DEFAULT_SKIP)  # a subclass: read raw by its parent
    assert is_target_linear(out_proj, "attn.out_proj", DEFAULT_SKIP, exact=False)  # LoRA adapts any linear
    for config in (QuantizationConfig("nf4"), QATConfig("int8-weight-only")):
        assert config.wants(nn.Linear(2, 2), "fc") and not config.wants(head, "lm_head")


def test_quantization_qat_fp8_take_a_dict_of_fields_as_lora_does():
    """quantization={"mode": "nf4"} (a dict, as lora= takes one) failed in an AttributeError inside the config."""
    pytest.importorskip("bitsandbytes")
    config = TransformConfig(quantization={"mode": "nf4", "compute_dtype": "bfloat16"}, lora={"r": 4})
    assert config.quantization == QuantizationConfig("nf4", compute_dtype=torch.bfloat16)
    assert TransformConfig(qat={"scheme": "int4-weight-only", "group_size": 64}).qat == QATConfig(
        "int4-weight-only", group_size=64
    )
    strategy = LowPrecisionStrategy(quantization={"mode": "int8"})
    assert strategy.transform_config.quantization.mode == "int8"


@pytest.mark.parametrize(
    ("value", "error", "says"),
    [
        ({"mode": "nf4", "threshold": 1.0}, ValueError, r"'threshold' is no field of QuantizationConfig. Its fields"),
        ({"compute_dtype": "bfloat16"}, ValueError, r"not a valid QuantizationConfig: .*'mode'"),
        (["nf4"], TypeError, r"quantization= takes a mode name, a QuantizationConfig or a dict of its fields, got"),
    ],
)
def test_a_bad_quantization_value_is_refused_naming_it(value, error, says):
    with pytest.raises(error, match=says):
        LowPrecisionStrategy(quantization=value)
