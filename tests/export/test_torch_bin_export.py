"""A base of pytorch_model.bin files: the merged export reads it (and writes safetensors), and ``export --model DIR
--format gguf`` converts it, to what the same weights as safetensors give."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf_helpers import metadata
from gguf_helpers import shrunk_model as shrunk
from lightning_helpers import quiet_trainer
from loading_helpers import LlamaModule, bin_copy, count_unpickles, save_llama, save_tokenizer
from model_shapes import SMOLLM2_135M
from qlora_helpers import ids_loader

from pl_lowprec import LowPrecisionStrategy
from pl_lowprec.export.merged import merge_into_pretrained
from pl_lowprec.loading import PretrainedWeights
from pl_lowprec.loading.sources import checkpoint_files

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")


def test_merged_export_of_a_bin_base_writes_safetensors_that_load_as_the_safetensors_base_merged(tmp_path, monkeypatch):
    """Each .bin shard is unpickled once (it was twice: its headers, then its tensors, as the streamed load did
    before ``WeightFiles``)."""
    directory = save_llama(tmp_path / "st", hidden_size=64)
    bin_dir = bin_copy(directory, tmp_path / "bin", shards=2)
    lora = {"r": 4, "target_modules": ["q_proj", "v_proj"]}
    trainer = quiet_trainer(strategy=LowPrecisionStrategy(pretrained=bin_dir, lora=lora), max_steps=2)
    with trainer.init_module(empty_init=True):
        model = LlamaModule(hidden_size=64)
    trainer.fit(model, ids_loader(batches=2))
    outs = {}
    loads = count_unpickles(monkeypatch)  # the .bin merge's; the safetensors one calls no torch.load
    for name, source in (("from_bin", bin_dir), ("from_safetensors", directory)):
        outs[name] = tmp_path / name
        outs[name].mkdir()
        merge_into_pretrained(model, PretrainedWeights(source, prefix="model."), outs[name])
    assert sorted(loads) == checkpoint_files(bin_dir)
    written = sorted(p.name for p in outs["from_bin"].iterdir() if "safetensors" in p.name or ".bin" in p.name)
    assert written == [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)] + ["model.safetensors.index.json"]
    weight_map = json.loads((outs["from_bin"] / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(weight_map.values()) == {f"model-0000{i}-of-00002.safetensors" for i in (1, 2)}
    from safetensors.torch import load_file

    files = {
        name: {k: v for f in sorted(out.glob("*.safetensors")) for k, v in load_file(f).items()}
        for name, out in outs.items()
    }
    assert set(files["from_bin"]) == set(files["from_safetensors"])
    for key, tensor in files["from_safetensors"].items():
        assert torch.equal(files["from_bin"][key], tensor), key
    merged_bin = transformers.AutoModelForCausalLM.from_pretrained(outs["from_bin"]).state_dict()
    merged_st = transformers.AutoModelForCausalLM.from_pretrained(outs["from_safetensors"]).state_dict()
    original = transformers.AutoModelForCausalLM.from_pretrained(directory).state_dict()
    assert not torch.equal(
        merged_bin["model.layers.0.self_attn.q_proj.weight"], original["model.layers.0.self_attn.q_proj.weight"]
    )
    assert set(merged_bin) == set(merged_st)
    for key, tensor in merged_st.items():
        assert torch.equal(merged_bin[key], tensor), key


def test_gguf_of_a_bin_model_directory_holds_the_tensors_of_the_safetensors_one(tmp_path, capsys, monkeypatch):
    """``--gguf_type auto,q8_0`` of a .bin directory unpickles each shard once (it was 5 times for the first and 4
    for the second: the auto type, then each type's headers and tensors)."""
    pytest.importorskip("gguf")
    from pl_lowprec.cli import main

    tokenizer = save_tokenizer(tmp_path / "tokenizer")
    directory = shrunk(tmp_path / "st", tokenizer, SMOLLM2_135M, 32, 320, bos_token_id=0, eos_token_id=1)
    bin_dir = bin_copy(directory, tmp_path / "bin", shards=2, tied_key=True)  # tied: lm_head saved too, not written
    main(["export", f"--model={directory}", f"--out={tmp_path / 'st-gguf'}", "--format=gguf", "--gguf_type=auto,q8_0"])
    loads = count_unpickles(monkeypatch)
    main(["export", f"--model={bin_dir}", f"--out={tmp_path / 'bin-gguf'}", "--format=gguf", "--gguf_type=auto,q8_0"])
    assert sorted(loads) == checkpoint_files(bin_dir)
    assert "model-bf16.gguf" in capsys.readouterr().out
    for file in ("model-bf16.gguf", "model-q8_0.gguf"):
        (fields_st, tensors_st), (fields_bin, tensors_bin) = (
            metadata(tmp_path / d / file) for d in ("st-gguf", "bin-gguf")
        )
        assert list(tensors_bin) == list(tensors_st), file
        for name, tensor in tensors_st.items():
            assert np.array_equal(np.asarray(tensors_bin[name].data), np.asarray(tensor.data)), (file, name)
        assert {k: v for k, v in fields_bin.items() if k != "general.name"} == {
            k: v for k, v in fields_st.items() if k != "general.name"
        }, file


def test_merged_export_of_a_tied_bin_base_saves_the_shared_weight_once(tmp_path):
    """torch.save of a tied model writes lm_head.weight and the embedding as one storage, which safetensors refuses
    to save twice: the merge writes it once, as save_pretrained does, and loads as the safetensors base merged."""
    directory = save_llama(tmp_path / "st", hidden_size=64, tie=True)
    bin_dir = bin_copy(directory, tmp_path / "bin", tied_key=True)
    lora = {"r": 4, "target_modules": ["q_proj", "v_proj"]}
    trainer = quiet_trainer(strategy=LowPrecisionStrategy(pretrained=bin_dir, lora=lora), max_steps=1)
    with trainer.init_module(empty_init=True):
        model = LlamaModule(hidden_size=64, tie=True)
    trainer.fit(model, ids_loader(batches=1))
    loaded = {}
    for name, source in (("from_bin", bin_dir), ("from_safetensors", directory)):
        (tmp_path / name).mkdir()
        merge_into_pretrained(model, PretrainedWeights(source, prefix="model."), tmp_path / name)
        loaded[name] = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name).state_dict()
    from safetensors.torch import load_file

    assert "lm_head.weight" not in load_file(tmp_path / "from_bin" / "model.safetensors")
    for key, tensor in loaded["from_safetensors"].items():
        assert torch.equal(loaded["from_bin"][key], tensor), key
