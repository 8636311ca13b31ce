"""pretrained= as pytorch_model.bin (or its shards), loaded as from_pretrained loads it, streamed through
torch.load(mmap=True, weights_only=True): every reader of a checkpoint takes it where it takes safetensors."""

from __future__ import annotations

import json
import zipfile

import pytest
import torch
from lightning_helpers import quiet_trainer
from loading_helpers import bin_copy, count_unpickles, llama_config, save_llama, stand_in_hub
from qlora_helpers import frozen_state

from pl_lowprec import LowPrecisionStrategy
from pl_lowprec.loading import empty_weights, load_pretrained
from pl_lowprec.loading.hub import resolve_pretrained
from pl_lowprec.loading.sources import PretrainedWeights, checkpoint_files, config_only
from pl_lowprec.models import CausalLM

transformers = pytest.importorskip("transformers")


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().reshape(-1).view(torch.uint8)


def _assert_same_bytes(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert torch.equal(_bytes(a[key]), _bytes(b[key])), key


def _streamed(directory, dtype=torch.float32, tie=False):
    from transformers import LlamaForCausalLM

    with empty_weights():
        model = LlamaForCausalLM(llama_config(hidden_size=64, tie=tie)).to(dtype)
    load_pretrained(model, directory)
    return model


def _causal_lm(directory, strategy=None):
    """CausalLM as fit builds and fills it: by itself under a plain strategy, else by the strategy's transform."""
    model = CausalLM(str(directory))
    trainer = quiet_trainer(max_steps=0, **({"strategy": strategy} if strategy else {}))
    trainer.strategy._lightning_module = model
    model.trainer = trainer
    model.configure_model()
    if strategy is not None:
        strategy.transform.apply(model, trainer.precision_plugin, torch.device("cpu"))
    return model


@pytest.mark.parametrize(
    ("shards", "dtype", "tie", "tied_key"),
    [
        (1, torch.float32, False, False),
        (2, torch.bfloat16, False, False),
        (1, torch.float32, True, True),  # lm_head.weight saved too, sharing the embedding's storage
        (3, torch.bfloat16, True, False),
    ],
    ids=["single-fp32", "sharded-bf16", "tied-both-keys", "sharded-tied-bf16"],
)
def test_bin_loads_the_bytes_from_pretrained_loads(tmp_path, shards, dtype, tie, tied_key):
    directory = save_llama(tmp_path / "st", hidden_size=64, dtype=dtype, tie=tie)
    bin_dir = bin_copy(directory, tmp_path / "bin", shards=shards, tied_key=tied_key)
    assert {f.suffix for f in checkpoint_files(bin_dir)} == {".bin"} and len(checkpoint_files(bin_dir)) == shards
    reference = transformers.AutoModelForCausalLM.from_pretrained(bin_dir, dtype=dtype)
    streamed = _streamed(bin_dir, dtype, tie)
    _assert_same_bytes(streamed.state_dict(), reference.state_dict())
    if tie:
        assert streamed.lm_head.weight is streamed.model.embed_tokens.weight


def test_causal_lm_under_a_plain_strategy_loads_a_bin_directory(tmp_path):
    directory = save_llama(tmp_path / "st", hidden_size=32, layers=1, tie=True)
    bin_dir = bin_copy(directory, tmp_path / "bin", shards=2)
    reference = transformers.AutoModelForCausalLM.from_pretrained(bin_dir)
    model = _causal_lm(bin_dir)
    _assert_same_bytes(model.model.state_dict(), reference.state_dict())


def test_qlora_from_a_bin_quantizes_to_the_bytes_of_the_safetensors_copy(tmp_path):
    pytest.importorskip("bitsandbytes")
    directory = save_llama(tmp_path / "st", hidden_size=64, layers=1, dtype=torch.bfloat16)
    bin_dir = bin_copy(directory, tmp_path / "bin", shards=2)
    lora = {"r": 4, "target_modules": ["q_proj", "v_proj"]}

    def quantized(source):
        torch.manual_seed(0)
        return frozen_state(_causal_lm(source, LowPrecisionStrategy(quantization="nf4-dq", lora=lora)))

    from_bin, from_safetensors = quantized(bin_dir), quantized(directory)
    assert any(".absmax" in key for key in from_bin)
    _assert_same_bytes(from_bin, from_safetensors)


def test_safetensors_is_read_where_a_directory_holds_both(tmp_path):
    """As from_pretrained: the .bin beside it (here other weights) is not read."""
    directory = save_llama(tmp_path / "st", hidden_size=64, seed=1)
    other = bin_copy(save_llama(tmp_path / "other", hidden_size=64, seed=2), tmp_path / "other_bin")
    (directory / "pytorch_model.bin").write_bytes((other / "pytorch_model.bin").read_bytes())
    assert checkpoint_files(directory) == [directory / "model.safetensors"]
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory)
    _assert_same_bytes(_streamed(directory).state_dict(), reference.state_dict())


class Payload:
    """Anything but a tensor: unpickling it would run its class's code."""


@pytest.mark.parametrize(
    ("content", "said"),
    [
        ({"weight": torch.zeros(2), "extra": Payload()}, r"holds more than plain tensors .*arbitrary code"),
        ([torch.zeros(2)], r"is not a state dict of tensors \(list"),
        ({"state_dict": {"weight": torch.zeros(2)}}, r"is not a state dict of tensors \(state_dict"),
    ],
    ids=["pickled-object", "list", "nested"],
)
def test_a_bin_that_is_not_plain_tensors_is_refused_naming_the_file(tmp_path, content, said):
    torch.save(content, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text(json.dumps(llama_config(hidden_size=64).to_dict()))
    with pytest.raises(ValueError, match=said) as refused:
        load_pretrained(torch.nn.Linear(2, 2), tmp_path)
    assert str(tmp_path / "pytorch_model.bin") in str(refused.value)


def test_a_legacy_torch_file_is_refused_as_unmappable(tmp_path):
    torch.save({"weight": torch.zeros(2, 2)}, tmp_path / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    assert not zipfile.is_zipfile(tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"not in torch's zip format: .*before 1.6.*save_pretrained"):
        load_pretrained(torch.nn.Linear(2, 2), tmp_path)


def test_a_bin_directory_is_not_taken_for_a_config_only_one(tmp_path):
    """The estimate and plan read a directory with config.json alone as shapes; one with .bin weights has weights."""
    directory = save_llama(tmp_path / "st", hidden_size=32, layers=1)
    bin_dir = bin_copy(directory, tmp_path / "bin")
    assert not config_only(bin_dir)
    (bin_dir / "pytorch_model.bin").unlink()
    assert config_only(bin_dir)
    with pytest.raises(FileNotFoundError, match=r"has a config\.json but no weights"):
        PretrainedWeights(bin_dir)


def test_a_hub_repository_with_only_bin_weights_downloads_them_and_one_with_both_only_safetensors(
    tmp_path, monkeypatch
):
    directory = save_llama(tmp_path / "st", hidden_size=64)
    bin_dir = bin_copy(directory, tmp_path / "bin", shards=2)
    (bin_dir / "training_args.bin").write_bytes(b"not weights")
    both = bin_copy(directory, tmp_path / "both")
    for file in directory.glob("*.safetensors"):
        (both / file.name).write_bytes(file.read_bytes())
    stand_in_hub(monkeypatch, tmp_path / "cache", {"org/old": bin_dir, "org/both": both})
    old = resolve_pretrained("org/old")
    assert sorted(p.name for p in old.glob("*.bin")) == [f"pytorch_model-0000{i}-of-00002.bin" for i in (1, 2)]
    reference = transformers.AutoModelForCausalLM.from_pretrained(bin_dir)
    _assert_same_bytes(_streamed(old).state_dict(), reference.state_dict())
    fetched = resolve_pretrained("org/both")
    assert not list(fetched.glob("*.bin")) and (fetched / "model.safetensors").is_file()


def test_a_single_state_dict_file_loads_as_its_directory_does(tmp_path):
    """pretrained= a .bin or .pt file itself (torch.save(model.state_dict())), as a .safetensors file is taken."""
    directory = save_llama(tmp_path / "st", hidden_size=64)
    bin_dir = bin_copy(directory, tmp_path / "bin")
    state_file = (bin_dir / "pytorch_model.bin").rename(tmp_path / "weights.pt")
    reference = transformers.AutoModelForCausalLM.from_pretrained(directory)
    _assert_same_bytes(_streamed(state_file).state_dict(), reference.state_dict())


def test_each_bin_shard_is_unpickled_once_per_load(tmp_path, monkeypatch):
    """A 2-shard .bin was unpickled (~20 ms each) for every module that read from it, and twice more for its
    headers: once a file now, the tensors' bytes unchanged."""
    directory = save_llama(tmp_path / "st", hidden_size=64)
    bin_dir = bin_copy(directory, tmp_path / "bin", shards=2)
    loads = count_unpickles(monkeypatch)
    streamed = _streamed(bin_dir)
    assert sorted(loads) == checkpoint_files(bin_dir)
    reference = transformers.AutoModelForCausalLM.from_pretrained(bin_dir)
    _assert_same_bytes(streamed.state_dict(), reference.state_dict())
