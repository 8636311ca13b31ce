"""``CausalLM.load_from_checkpoint(path)``, which Lightning runs without a Trainer, so without the strategy: a
checkpoint of the whole model loads (the weights equal the trained ones); the strategy's adapter-only checkpoint is
refused in one paragraph naming what it holds and how to load it (it failed with "CausalLM is not attached to a
`Trainer`", and a module built by hand with torch's missing/unexpected-key lines)."""

import pytest
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning_helpers import quiet_trainer
from loading_helpers import save_pretrained_dir, write_prompt_completion

from pl_lowprec import LowPrecisionStrategy
from pl_lowprec.data import TextDataModule
from pl_lowprec.models import CausalLM

pytest.importorskip("transformers")
pytest.importorskip("peft")


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    return save_pretrained_dir(tmp_path_factory.mktemp("pretrained"), hidden_size=32, layers=2)


def _trained(pretrained, tmp_path, strategy):
    path = write_prompt_completion(tmp_path / "pc.jsonl", n=8)
    data = TextDataModule(train_files=str(path), tokenizer=str(pretrained), batch_size=4, val_fraction=0)
    trainer = quiet_trainer(strategy=strategy, max_steps=1, limit_val_batches=0)
    model = CausalLM(str(pretrained), lr=1e-2, warmup_steps=0)
    trainer.fit(model, datamodule=data)
    checkpoint = tmp_path / "trained.ckpt"
    trainer.save_checkpoint(checkpoint)
    return model, checkpoint


def test_an_adapter_only_checkpoint_is_refused_in_one_paragraph_naming_the_fix(pretrained, tmp_path):
    strategy = LowPrecisionStrategy(lora={"r": 2, "target_modules": ["q_proj", "v_proj"]})
    _, checkpoint = _trained(pretrained, tmp_path, strategy)
    with pytest.raises(ValueError) as refused:
        CausalLM.load_from_checkpoint(checkpoint)
    said = str(refused.value)
    assert "\n" not in said
    assert said.startswith("CausalLM.load_from_checkpoint got an adapter-only checkpoint (the strategy's")
    assert "its 8 tensors are LoRA weights (model.model.layers.0.self_attn.q_proj.lora_A.default.weight, ...)" in said
    assert f"it comes from pretrained={str(pretrained)!r}" in said
    assert ".validate(CausalLM(pretrained), datamodule=..., ckpt_path=PATH)" in said
    assert "`pl-lowprec export --ckpt_path PATH`" in said


def test_a_whole_model_checkpoint_loads_the_trained_weights(pretrained, tmp_path):
    trained, checkpoint = _trained(pretrained, tmp_path, SingleDeviceStrategy(torch.device("cpu")))
    loaded = CausalLM.load_from_checkpoint(checkpoint)
    expected, got = trained.state_dict(), loaded.state_dict()
    assert set(got) == set(expected)
    from transformers import AutoModelForCausalLM

    base = {f"model.{k}": v for k, v in AutoModelForCausalLM.from_pretrained(pretrained).state_dict().items()}
    assert any(not torch.equal(base[k], v) for k, v in expected.items() if k in base)  # it trained: not the base
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor), key
