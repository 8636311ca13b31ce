"""LowPrecisionFSDPStrategy refuses what it cannot run when it is built or handed to the Trainer (no processes)."""

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn

from pl_lowprec import AMPPrecision, LowPrecisionFSDPStrategy, QuantizationConfig
from pl_lowprec.distributed.shard import check_trainable_dtypes, shard_units, step_methods
from pl_lowprec.transforms.nf4 import NF4Layout, check_layout, describe_choice


def test_registered_as_lowprec_fsdp():
    assert StrategyRegistry["lowprec_fsdp"]["strategy"] is LowPrecisionFSDPStrategy


def test_quantization_with_tensor_parallelism_is_refused():
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2: 4-bit weights cannot be split by tensor paral"):
        LowPrecisionFSDPStrategy(quantization="nf4", tensor_parallel_size=2)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2: it shards data only"):
        LowPrecisionFSDPStrategy(tensor_parallel_size=2)


@pytest.mark.parametrize("mode", ["fp4", "fp4-dq", "int8"])
def test_bitsandbytes_only_modes_are_refused(mode):
    with pytest.raises(ValueError, match=rf"quantization='{mode}' cannot shard.*Allowed: 'nf4', 'nf4-dq'.*#1424"):
        LowPrecisionFSDPStrategy(quantization=mode, lora={"r": 4})


@pytest.mark.parametrize("name", ["adamw8bit", "paged_adamw8bit", "lion8bit"])
def test_bitsandbytes_optimizers_are_refused_with_the_torchao_alternative(name):
    with pytest.raises(
        ValueError, match=rf"optimizer='{name}': bitsandbytes' optimizer kernels .* do not take DTensors"
    ):
        LowPrecisionFSDPStrategy(optimizer=name)
    with pytest.raises(ValueError, match=r"Use\s+optimizer='torchao_adamw8bit'"):
        LowPrecisionFSDPStrategy(optimizer=name)
    assert LowPrecisionFSDPStrategy(optimizer="torchao_adamw8bit").transform_config.optimizer == "torchao_adamw8bit"


def test_qat_conversion_of_a_sharded_model_is_refused_with_how_to_convert():
    from pl_lowprec.transforms.qat import QATConfig

    with pytest.raises(
        ValueError, match=r"qat='int4-weight-only' with convert_on_fit_end=True.*convert_on_fit_end=Fal"
    ):
        LowPrecisionFSDPStrategy(qat="int4-weight-only")
    LowPrecisionFSDPStrategy(qat=QATConfig("int4-weight-only", convert_on_fit_end=False))


def test_options_that_replace_the_linear_layers_still_exclude_quantization():
    with pytest.raises(ValueError, match=r"quantization= and fp8= cannot be combined"):
        LowPrecisionFSDPStrategy(quantization="nf4", fp8="tensorwise")


@pytest.mark.parametrize("precision", ["16-true", "64-true"])
def test_precisions_it_cannot_run_are_refused_when_the_trainer_is_built(precision):
    with pytest.raises(ValueError) as err:
        pl.Trainer(strategy=LowPrecisionFSDPStrategy(), accelerator="cpu", devices=2, precision=precision)
    message = str(err.value)
    assert precision in message or "Precision" in message
    if precision == "16-true":  # Lightning lets 16-true through to the strategy, which names what it runs
        assert "cannot run HalfPrecision('16-true')" in message and "AMPPrecision('bf16-mixed'" in message


@pytest.mark.parametrize("precision", ["32-true", "bf16-true", "bf16-mixed"])
def test_precisions_it_runs_are_accepted(precision):
    trainer = pl.Trainer(strategy=LowPrecisionFSDPStrategy(), accelerator="cpu", devices=2, precision=precision)
    assert trainer.strategy.precision_plugin.precision == precision


def test_amp_precision_is_accepted():
    trainer = pl.Trainer(
        strategy=LowPrecisionFSDPStrategy(), accelerator="cpu", devices=2, plugins=[AMPPrecision("16-mixed")]
    )
    assert isinstance(trainer.strategy.precision_plugin, AMPPrecision)


def test_unknown_shard_unit_lists_the_model_classes():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(ValueError, match=r"shard_modules: 'Block' matches no module.*Linear, ReLU, Sequential"):
        shard_units(model, "Block")
    with pytest.raises(ValueError, match=r"it declares none .*: pass shard_modules=.*Linear, ReLU, Sequential"):
        shard_units(model, None)


def test_without_shard_modules_the_units_are_the_blocks_the_model_declares():
    """A Hugging Face model inside a module of the user's own: its _no_split_modules, as accelerate wraps."""
    from loading_helpers import llama_config
    from transformers import LlamaForCausalLM

    holder = nn.Module()
    holder.model = LlamaForCausalLM(llama_config(layers=3))
    for policy in (None, "auto"):
        units = shard_units(holder, policy)
        assert [name for name, _ in units] == [f"model.model.layers.{i}" for i in range(3)]


def test_the_root_runs_the_step_methods_the_module_defines():
    import lightning.pytorch as pl

    from pl_lowprec.demo import TinyGPT

    assert step_methods(TinyGPT()) == ["training_step", "validation_step", "test_step", "predict_step"]

    class TrainOnly(pl.LightningModule):
        def training_step(self, batch, batch_idx):
            return None

    assert step_methods(TrainOnly()) == ["training_step"]  # no validation_step for Lightning to find
    assert step_methods(nn.Linear(2, 2)) == []


def test_trainable_parameters_in_two_dtypes_are_refused():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4).to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"Trainable parameters in 2 dtypes.*torch.bfloat16: 1.weight"):
        check_trainable_dtypes(model)


def test_nf4_layout_names_what_does_not_split():
    layout = NF4Layout(block_size=64, scaler_block_size=64)
    assert layout.problem((64, 64), world_size=1) is None
    assert "scale group(s) do not split evenly across 2 ranks" in layout.problem((64, 64), world_size=2)
    assert "rows do not split" in NF4Layout(64, 2).problem((3, 256), world_size=2)
    assert "do not fill blocks" in layout.problem((3, 7), world_size=1)
    assert layout.scaler_block_sizes_that_fit([(64, 64), (128, 64)], world_size=2)[0] == 32
    assert QuantizationConfig("nf4-dq").mode == "nf4-dq"
    with pytest.raises(ValueError, match="nf4_scaler_block_size=3"):
        NF4Layout(64, 3)


# SmolLM2-135M's projections (hidden 576, 3 of 9 heads for K/V, MLP 1536): torchao's 256 does not split them all
SMOLLM2 = {"q_proj": (576, 576), "k_proj": (192, 576), "gate_proj": (1536, 576), "down_proj": (576, 1536)}


def test_auto_scaler_block_size_picks_per_layer_the_largest_that_splits(caplog):
    auto = NF4Layout()
    assert auto.scaler_block_size == "auto"
    chosen = {name: auto.for_weight(shape, world_size=2).scaler_block_size for name, shape in SMOLLM2.items()}
    assert chosen == {"q_proj": 32, "k_proj": 32, "gate_proj": 256, "down_proj": 256}
    # 5184 blocks of q_proj: 81 groups of 64 fill on one process, not across 2 ranks
    assert auto.for_weight(SMOLLM2["q_proj"], world_size=1).scaler_block_size == 64
    model = nn.ModuleDict(
        {name: nn.Linear(shape[1], shape[0], bias=False, device="meta") for name, shape in SMOLLM2.items()}
    )
    sizes = check_layout(model, QuantizationConfig("nf4"), auto, world_size=2)
    assert sizes == chosen
    assert describe_choice({"q_proj": 64}, world_size=1) == (
        "NF4 nf4_scaler_block_size='auto' on 1 process: 64 for 1 layer (q_proj)."
    )
    line = describe_choice(sizes, world_size=2)
    assert line == (
        "NF4 nf4_scaler_block_size='auto' across 2 ranks: 256 for 2 layers (gate_proj, down_proj); 32 for 2 layers"
        " (q_proj, k_proj)."
    )
    # an explicit size keeps its strict check, and the message names the sizes that fit and 'auto'
    with pytest.raises(
        ValueError,
        match=r"2 of 4 layers .*nf4_scaler_block_size=256\): q_proj \[576, 576\]: its"
        r" 5184 blocks do not fill groups.*Pass nf4_scaler_block_size=32 .*or 'auto'",
    ):
        check_layout(model, QuantizationConfig("nf4"), NF4Layout(64, 256), world_size=2)
    odd = nn.ModuleDict({"odd": nn.Linear(256, 3, bias=False, device="meta")})
    with pytest.raises(
        ValueError, match=r"odd \[3, 256\]: its 3 rows do not split evenly across 2 ranks.*skip_modules"
    ):
        check_layout(odd, QuantizationConfig("nf4"), auto, world_size=2)
    with pytest.raises(
        ValueError, match=r"nf4_scaler_block_size='big' is not valid: use an even integer >= 2 or 'auto'"
    ):
        NF4Layout(64, "big")


def test_missing_torchao_fails_when_the_strategy_is_built(monkeypatch):
    from pl_lowprec import _imports

    class Missing:
        message = "torchao is not installed"

        def __bool__(self):
            return False

    monkeypatch.setattr(_imports, "_TORCHAO", Missing())
    _imports.import_torchao_nf4.cache_clear()
    try:
        with pytest.raises(ModuleNotFoundError, match=r'torchao is not installed.*pip install "pl_lowprec\[fsdp\]"'):
            LowPrecisionFSDPStrategy(quantization="nf4")
        LowPrecisionFSDPStrategy(lora={"r": 4})  # no quantization: torchao not needed
    finally:
        _imports.import_torchao_nf4.cache_clear()
