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

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")


def test_merged_export_of_a_bin_base_writes_safetensors_that_load_as_the_safetensors_base_merged(tmp_path):
    directory = save_llama(tmp_path / "st", hidden_size=64)
    bin_dir = bin_copy(directory, tmp_path / "bin", shards=2)
    lora = {"r": 4, "target_modules": ["q_proj", "v_proj"]}
    trainer = quiet_trainer(strategy=LowPrecisionStrategy(pretrained=bin_dir, lora=lora), max_steps=2)
    with trainer.init_module(empty_init=True):
        model = LlamaModule(hidden_size=64)
    trainer.fit(model, ids_loader(batches=2))
    outs = {}
    for name, source in (("from_bin", bin_dir), ("from_safetensors", directory)):
        outs[name] = tmp_path / name
        outs[name].mkdir()
        merge_into_pretrained(model, PretrainedWeights(source, prefix="model."), outs[name])
    written = sorted(p.name for p in outs["from_bin"].iterdir() if "safetensors" in p.name or ".bin" in p.name)
    assert written == [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)] + ["model.safetensors.index.json"]
    weight_map = json.loads((outs["from_bin"] / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(weight_map.values()) == {f"model-0000{i}-of-00002.safetensors" for i in (1, 2)}
    merged_bin = transformers.AutoModelForCausalLM.from_pretrained(outs["from_bin"]).state_dict()
    merged_st = transformers.AutoModelForCausalLM.from_pretrained(outs["from_safetensors"]).state_dict()
    original = transformers.AutoModelForCausalLM.from_pretrained(directory).state_dict()
    assert not torch.equal(
        merged_bin["model.layers.0.self_attn.q_proj.weight"], original["model.layers.0.self_attn.q_proj.weight"]
    )
    assert set(merged_bin) == set(merged_st)
    for key, tensor in merged_st.items():
        assert torch.equal(merged_bin[key], tensor), key


def test_gguf_of_a_bin_model_directory_holds_the_tensors_of_the_safetensors_one(tmp_path, capsys):
    pytest.importorskip("gguf")
    from pl_lowprec.cli import main

    tokenizer = save_tokenizer(tmp_path / "tokenizer")
    directory = shrunk(tmp_path / "st", tokenizer, SMOLLM2_135M, 32, 320, bos_token_id=0, eos_token_id=1)
    bin_dir = bin_copy(directory, tmp_path / "bin", shards=2, tied_key=True)  # tied: lm_head saved too, not written
    files = {}
    for name, source in (("st", directory), ("bin", bin_dir)):
        main(["export", f"--model={source}", f"--out={tmp_path / f'{name}-gguf'}", "--format=gguf"])
        files[name] = metadata(tmp_path / f"{name}-gguf" / "model-bf16.gguf")
    assert "model-bf16.gguf" in capsys.readouterr().out
    (fields_st, tensors_st), (fields_bin, tensors_bin) = files["st"], files["bin"]
    assert set(tensors_bin) == set(tensors_st)
    for name, tensor in tensors_st.items():
        assert np.array_equal(np.asarray(tensors_bin[name].data), np.asarray(tensor.data)), name
    assert {k: v for k, v in fields_bin.items() if k != "general.name"} == {
        k: v for k, v in fields_st.items() if k != "general.name"
    }


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


def test_the_merged_export_unpickles_each_bin_shard_once(tmp_path, monkeypatch):
    """It read each shard twice (its headers, then its tensors), as the streamed load did before
    ``WeightFiles``: once now, the written tensors equal to those merged from the same weights as safetensors."""
    from safetensors.torch import load_file

    from pl_lowprec.loading.sources import checkpoint_files

    directory = save_llama(tmp_path / "st", hidden_size=64)
    bin_dir = bin_copy(directory, tmp_path / "bin", shards=2)
    lora = {"r": 4, "target_modules": ["q_proj", "v_proj"]}
    trainer = quiet_trainer(strategy=LowPrecisionStrategy(pretrained=bin_dir, lora=lora), max_steps=1)
    with trainer.init_module(empty_init=True):
        model = LlamaModule(hidden_size=64)
    trainer.fit(model, ids_loader(batches=1))
    (tmp_path / "from_safetensors").mkdir()
    merge_into_pretrained(model, PretrainedWeights(directory, prefix="model."), tmp_path / "from_safetensors")
    loads = count_unpickles(monkeypatch)
    (tmp_path / "from_bin").mkdir()
    merge_into_pretrained(model, PretrainedWeights(bin_dir, prefix="model."), tmp_path / "from_bin")
    assert sorted(loads) == checkpoint_files(bin_dir)
    written = {}
    for name in ("from_bin", "from_safetensors"):
        written[name] = {k: v for f in sorted((tmp_path / name).glob("*.safetensors")) for k, v in load_file(f).items()}
    assert set(written["from_bin"]) == set(written["from_safetensors"])
    for key, tensor in written["from_safetensors"].items():
        assert torch.equal(written["from_bin"][key], tensor), key


def test_gguf_of_a_bin_model_directory_unpickles_each_shard_once_for_every_type(tmp_path, monkeypatch):
    """``--gguf_type auto,q8_0`` read the first shard 5 times and the second 4 (the auto type, then each type's
    headers and tensors): once each now, the files' tensors those of the safetensors directory."""
    pytest.importorskip("gguf")
    from pl_lowprec.cli import main
    from pl_lowprec.loading.sources import checkpoint_files

    tokenizer = save_tokenizer(tmp_path / "tokenizer")
    directory = shrunk(tmp_path / "st", tokenizer, SMOLLM2_135M, 32, 320, bos_token_id=0, eos_token_id=1)
    bin_dir = bin_copy(directory, tmp_path / "bin", shards=2, tied_key=True)
    main(["export", f"--model={directory}", f"--out={tmp_path / 'st-gguf'}", "--format=gguf", "--gguf_type=auto,q8_0"])
    loads = count_unpickles(monkeypatch)
    main(["export", f"--model={bin_dir}", f"--out={tmp_path / 'bin-gguf'}", "--format=gguf", "--gguf_type=auto,q8_0"])
    assert sorted(loads) == checkpoint_files(bin_dir)
    for name in ("model-bf16.gguf", "model-q8_0.gguf"):
        tensors_st, tensors_bin = (metadata(tmp_path / d / name)[1] for d in ("st-gguf", "bin-gguf"))
        assert list(tensors_bin) == list(tensors_st)
        for key, tensor in tensors_st.items():
            assert np.array_equal(np.asarray(tensors_bin[key].data), np.asarray(tensor.data)), key
