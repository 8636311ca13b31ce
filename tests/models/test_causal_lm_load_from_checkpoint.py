"""``CausalLM.load_from_checkpoint(path)``, which Lightning runs without a Trainer, so without the strategy: a
checkpoint of the whole model loads (the weights equal the trained ones); the strategy's adapter-only checkpoint is
refused in one paragraph naming what it holds and how to load it (it failed with "CausalLM is not attached to a
`Trainer`", and a module built by hand with torch's missing/unexpected-key lines)."""

import shutil
from pathlib import Path

import pytest
import torch
from lightning.pytorch.strategies import SingleDeviceStrategy
from lightning_helpers import quiet_trainer
from loading_helpers import count_safetensors_opens, save_pretrained_dir, write_prompt_completion

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


def _loads_from_shapes_alone(pretrained: Path, checkpoint: Path, expected: dict, tmp_path: Path) -> None:
    """A pretrained= of config.json alone is all the load of a whole checkpoint needs (it was refused as a
    directory holding no weights)."""
    shapes = tmp_path / "shapes"
    shapes.mkdir()
    shutil.copy(pretrained / "config.json", shapes / "config.json")
    from_shapes = CausalLM.load_from_checkpoint(checkpoint, pretrained=str(shapes)).state_dict()
    assert all(torch.equal(from_shapes[key], tensor) for key, tensor in expected.items())


def _loaded_from_the_checkpoint_alone(pretrained: Path, tmp_path: Path, monkeypatch) -> tuple[dict, CausalLM]:
    """The trained weights and the model CausalLM.load_from_checkpoint gives back, having opened no pretrained file
    (every weight was streamed from pretrained= and then overwritten by the checkpoint's: read twice); the same load
    from a pretrained= of config.json alone."""
    trained, checkpoint = _trained(pretrained, tmp_path, SingleDeviceStrategy(torch.device("cpu")))
    opened = count_safetensors_opens(monkeypatch, pretrained)
    loaded = CausalLM.load_from_checkpoint(checkpoint)
    assert opened == []
    expected, got = trained.state_dict(), loaded.state_dict()
    assert set(got) == set(expected)
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor), key
    assert all(not p.is_meta for p in loaded.parameters())
    _loads_from_shapes_alone(pretrained, checkpoint, expected, tmp_path)
    return expected, loaded


def test_a_whole_model_checkpoint_loads_the_trained_weights(pretrained, tmp_path, monkeypatch):
    expected, loaded = _loaded_from_the_checkpoint_alone(pretrained, tmp_path, monkeypatch)
    from transformers import AutoModelForCausalLM

    base = {f"model.{k}": v for k, v in AutoModelForCausalLM.from_pretrained(pretrained).state_dict().items()}
    assert any(not torch.equal(base[k], v) for k, v in expected.items() if k in base)  # it trained: not the base
    assert loaded.model.get_output_embeddings().weight is not loaded.model.get_input_embeddings().weight


def test_a_tied_checkpoint_loads_with_its_head_and_embedding_one_tensor(tmp_path, monkeypatch):
    pretrained = save_pretrained_dir(tmp_path / "pretrained", hidden_size=32, layers=2, tie=True)
    _, loaded = _loaded_from_the_checkpoint_alone(pretrained, tmp_path, monkeypatch)
    assert loaded.model.get_output_embeddings().weight is loaded.model.get_input_embeddings().weight


def test_a_checkpoint_without_some_weights_takes_them_from_the_pretrained_files(pretrained, tmp_path, monkeypatch):
    """Loaded with strict=False, a checkpoint saved without a weight still gets it from pretrained=, as before."""
    trained, checkpoint = _trained(pretrained, tmp_path, SingleDeviceStrategy(torch.device("cpu")))
    saved = torch.load(checkpoint, weights_only=True)
    del saved["state_dict"]["model.model.norm.weight"]
    partial = tmp_path / "partial.ckpt"
    torch.save(saved, partial)
    opened = count_safetensors_opens(monkeypatch, pretrained)
    loaded = CausalLM.load_from_checkpoint(partial, strict=False)
    assert "model.safetensors" in opened
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(pretrained).model.norm.weight
    assert torch.equal(loaded.model.model.norm.weight, original)
    for key, tensor in trained.state_dict().items():
        if key != "model.model.norm.weight":
            assert torch.equal(loaded.state_dict()[key], tensor), key


def test_validate_of_a_whole_checkpoint_reads_the_base_only_under_lightnings_own_strategy(
    pretrained, tmp_path, monkeypatch
):
    """Under Lightning's own strategy, CausalLM loads its weights in ``configure_model``, which Lightning runs before
    it restores the checkpoint, with no sign of it (``trainer.ckpt_path`` is set after, and no hook runs between
    them when none comes, before ``setup`` converts and wraps the model): every weight is read, then overwritten.
    ``LowPrecisionStrategy()`` without options restores before loading (``checkpoint_fills.py``): it reads none and
    gives the same loss."""
    _, checkpoint = _trained(pretrained, tmp_path, SingleDeviceStrategy(torch.device("cpu")))
    path = write_prompt_completion(tmp_path / "val.jsonl", n=8)
    losses, opens = {}, {}
    for name, strategy in (
        ("lightning", SingleDeviceStrategy(torch.device("cpu"))),
        ("lowprec", LowPrecisionStrategy()),
    ):
        data = TextDataModule(train_files=str(path), val_files=str(path), tokenizer=str(pretrained), batch_size=4)
        opened = count_safetensors_opens(monkeypatch, pretrained)
        trainer = quiet_trainer(strategy=strategy)
        (losses[name],) = trainer.validate(
            CausalLM(str(pretrained)), datamodule=data, ckpt_path=checkpoint, verbose=False
        )
        opens[name] = len(opened)
    assert opens == {"lightning": 22, "lowprec": 0}  # the headers, then once per module
    assert losses["lowprec"] == losses["lightning"]
