"""modules_to_save naming a layer stored as torchao NF4 (lowprec_fsdp's quantization) is refused in one paragraph."""

import pytest
import torch

pytest.importorskip("torchao")
pytest.importorskip("peft")
from pl_lowprec.demo import TinyLlama
from pl_lowprec.transforms.lora import inject_lora
from pl_lowprec.transforms.nf4 import NF4Layout, is_nf4, quantize_model_nf4
from pl_lowprec.transforms.quantization import QuantizationConfig


def test_modules_to_save_naming_an_nf4_layer_is_refused():
    # NF4Tensor says it is floating point, so the integer check let it through: peft's trained copy re-quantized
    # it and stopped in torchao ("AssertionError: Number of scalers must be divisible by scaler block size, got
    # 576 scaler_block_size 256"), a traceback under lowprec_fsdp on 1 or 2 ranks.
    model = TinyLlama(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, max_len=32)
    quantize_model_nf4(model, QuantizationConfig("nf4"), NF4Layout(scaler_block_size=32), torch.device("cpu"))
    assert is_nf4(model.model.model.layers[0].mlp.down_proj.weight)
    with pytest.raises(
        ValueError, match=r"modules_to_save names model.model.layers.0.mlp.down_proj, .*Fix: add it to quantization's"
    ):
        inject_lora(model, {"r": 4, "target_modules": ["q_proj"], "modules_to_save": ["down_proj"]})
