"""pretrained=: a module built on the meta device is filled from safetensors, quantized as it loads."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch.plugins.precision import Precision
from lightning_helpers import quiet_trainer
from loading_helpers import llama_config, save_llama
from qlora_helpers import frozen_state, ids_loader, tiny_llama
from safetensors.torch import load_file

from pl_lowprec import LowPrecisionStrategy
from pl_lowprec.loading import empty_weights, load_pretrained
from pl_lowprec.transforms.quantization import QuantizationConfig, quantize_model

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")


def _full_load_then_quantize(directory, mode):
    """The reference: a module with weights, the whole checkpoint loaded, then quantized."""
    model = tiny_llama()
    state = {}
    for file in sorted(directory.glob("*.safetensors")):
        state.update({f"model.{k}": v for k, v in load_file(file).items()})
    model.load_state_dict(state, strict=True)
    if mode is not None:
        quantize_model(model, QuantizationConfig.from_mode(mode), torch.float32, torch.device("cpu"))
    return model


def _streamed(directory, mode):
    with empty_weights():
        model = tiny_llama()
    assert all(p.is_meta for p in model.parameters())
    config = QuantizationConfig.from_mode(mode) if mode else None
    report = load_pretrained(model, directory, "model.", config, torch.float32, "cpu")
    return model, report


def _assert_identical(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for key in sa:
        if torch.is_tensor(sa[key]):
            assert sa[key].dtype == sb[key].dtype, key
            assert torch.equal(sa[key], sb[key]), key
        else:
            assert sa[key] == sb[key], key


@pytest.mark.parametrize("mode", [None, "nf4", "nf4-dq", "fp4", "int8"])
@pytest.mark.parametrize("sharded", [False, True])
def test_streamed_weights_are_byte_identical_to_quantizing_after_a_full_load(tmp_path, mode, sharded):
    directory = save_llama(tmp_path / "ckpt", hidden_size=64, max_shard_size="40KB" if sharded else None)
    assert (directory / "model.safetensors.index.json").is_file() == sharded
    streamed, report = _streamed(directory, mode)
    reference = _full_load_then_quantize(directory, mode)
    _assert_identical(streamed, reference)
    assert report.tensors == len(load_file_keys(directory))
    assert len(report.quantized) == (14 if mode else 0)  # 7 linear layers x 2 decoder layers; lm_head skipped
    ids = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(streamed(ids), reference(ids), rtol=0, atol=0)


def test_tensors_take_the_dtype_the_module_declares(tmp_path):
    """A bf16 checkpoint into an fp32-declared module: cast as load_state_dict would, before quantizing."""
    directory = save_llama(tmp_path / "ckpt", dtype=torch.bfloat16)
    assert {v.dtype for v in load_file(directory / "model.safetensors").values()} == {torch.bfloat16}
    streamed, _ = _streamed(directory, "nf4")
    _assert_identical(streamed, _full_load_then_quantize(directory, "nf4"))
    assert streamed.model.model.norm.weight.dtype == torch.float32


def load_file_keys(directory):
    return [k for f in directory.glob("*.safetensors") for k in load_file(f)]


def test_tied_embeddings_stay_one_tensor(tmp_path):
    directory = save_llama(tmp_path / "ckpt", tie=True)
    assert "lm_head.weight" not in load_file_keys(directory)  # save_pretrained writes a tied weight once
    from transformers import LlamaForCausalLM

    with empty_weights():
        model = LlamaForCausalLM(llama_config(tie=True))
    load_pretrained(model, directory, quantization=QuantizationConfig.from_mode("nf4"))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert not model.lm_head.weight.is_meta


def test_fit_loads_quantizes_and_trains_under_init_module(tmp_path):
    """The strategy argument: init_module builds on the meta device, setup streams the weights in."""
    directory = save_llama(tmp_path / "ckpt")
    strategy = LowPrecisionStrategy(
        pretrained=directory, pretrained_prefix="model.", quantization="nf4-dq", lora={"r": 4, "lora_alpha": 8}
    )
    trainer = quiet_trainer(strategy=strategy, max_steps=2)
    with trainer.init_module(empty_init=True):
        model = tiny_llama()
    assert all(p.is_meta for p in model.parameters())
    trainer.fit(model, ids_loader(batches=2))
    assert trainer.global_step == 2
    reference = _full_load_then_quantize(directory, None)
    LowPrecisionStrategy(quantization="nf4-dq", lora={"r": 4, "lora_alpha": 8}).transform.apply(
        reference, Precision(), torch.device("cpu")
    )
    frozen = frozen_state(model)
    assert len(frozen) == len(frozen_state(reference)) > 0
    for key, value in frozen_state(reference).items():
        assert torch.equal(frozen[key], value), key  # base weights are the pretrained ones, quantized
    # a second fit changes nothing: already loaded, quantized and adapted
    trainer2 = quiet_trainer(
        strategy=LowPrecisionStrategy(pretrained=directory, pretrained_prefix="model."), max_steps=1
    )
    trainer2.fit(model, ids_loader(batches=1))
    assert trainer2.global_step == 1


def test_resume_loads_the_base_then_the_adapter_checkpoint(tmp_path):
    directory = save_llama(tmp_path / "ckpt")
    kwargs = dict(pretrained=directory, pretrained_prefix="model.", quantization="nf4", lora={"r": 4})
    trainer = quiet_trainer(strategy=LowPrecisionStrategy(**kwargs), max_steps=2)
    with trainer.init_module(empty_init=True):
        model = tiny_llama()
    trainer.fit(model, ids_loader(batches=2))
    trainer.save_checkpoint(tmp_path / "last.ckpt")
    resumed = quiet_trainer(strategy=LowPrecisionStrategy(**kwargs), max_steps=2)
    with resumed.init_module(empty_init=True):
        fresh = tiny_llama()
    resumed.fit(fresh, ids_loader(batches=2), ckpt_path=tmp_path / "last.ckpt")  # already at max_steps
    assert resumed.global_step == 2
    for (name, a), b in zip(model.state_dict().items(), fresh.state_dict().values(), strict=True):
        if torch.is_tensor(a):
            assert torch.equal(a, b), name
