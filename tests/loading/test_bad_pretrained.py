"""Bad pretrained= input fails before any weight is read or any step runs, naming the keys and the fix."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from lightning_helpers import quiet_trainer
from loading_helpers import save_llama
from qlora_helpers import frozen_state, ids_loader, tiny_llama

from pl_lowprec import LowPrecisionStrategy
from pl_lowprec.loading import empty_weights, load_pretrained

pytest.importorskip("bitsandbytes")


def _meta_llama(**kwargs):
    with empty_weights():
        return tiny_llama(**kwargs)


def _fit_fails(directory, match, model=None, **strategy_kwargs):
    strategy = LowPrecisionStrategy(pretrained=directory, **{"pretrained_prefix": "model.", **strategy_kwargs})
    trainer = quiet_trainer(strategy=strategy, max_steps=1)
    with pytest.raises(ValueError, match=match):
        trainer.fit(model if model is not None else _meta_llama(), ids_loader(batches=1))
    assert trainer.global_step == 0


def test_missing_keys_are_named(tmp_path):
    directory = save_llama(tmp_path / "ckpt", layers=1)
    _fit_fails(
        directory,
        r"does not fit TinyLlama \(with pretrained_prefix='model.'\); nothing was loaded. Missing from the checkpoint:"
        r" model.model.layers.1.self_attn.q_proj.weight",
    )


def test_unexpected_keys_are_named(tmp_path):
    directory = save_llama(tmp_path / "ckpt", layers=3)
    _fit_fails(
        directory,
        r"In the checkpoint but not in the module: model.model.layers.2.input_layernorm.weight, .*\(9 in all\)",
    )


def test_shape_mismatch_is_named(tmp_path):
    directory = save_llama(tmp_path / "ckpt", hidden_size=32)
    _fit_fails(directory, r"Shapes differ: model.model.embed_tokens.weight: checkpoint \[256, 32\], module \[256, 64\]")


def test_without_a_prefix_the_one_under_which_every_key_fits_is_taken_and_said(tmp_path, caplog):
    """A module holding the Hugging Face model as self.model, pretrained_prefix not given: 'model.' is taken, the
    weights are those an explicit pretrained_prefix='model.' loads, and export's merge reads with it too."""
    from pl_lowprec.export.merged import merge_into_pretrained

    directory = save_llama(tmp_path / "ckpt")
    models = {}
    for prefix in (None, "model."):
        strategy = LowPrecisionStrategy(pretrained=directory, pretrained_prefix=prefix, lora={"r": 4})
        trainer = quiet_trainer(strategy=strategy, max_steps=1)
        with trainer.init_module(empty_init=True):
            models[prefix] = tiny_llama()
        with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
            trainer.fit(models[prefix], ids_loader(batches=1))
        assert strategy.transform.weights_for(models[prefix]).prefix == "model."
    said = [r.getMessage() for r in caplog.records if "took pretrained_prefix=" in r.getMessage()]
    assert said == [
        f"pretrained={str(directory)!r}: took pretrained_prefix='model.', under which every key and shape of the"
        " checkpoint matches TinyLlama's (name pretrained_prefix to choose another)."
    ]
    inferred, named = (frozen_state(models[p]) for p in (None, "model."))  # the base weights, as loaded
    assert inferred.keys() == named.keys() and len(named) > 0
    for key, value in named.items():
        assert torch.equal(inferred[key], value), key
    out = tmp_path / "merged"
    out.mkdir()
    weights = LowPrecisionStrategy(pretrained=directory).transform.weights_for(models[None])
    assert merge_into_pretrained(models[None], weights, out)["merged"] > 0


def test_a_prefix_is_taken_only_where_every_key_fits(tmp_path):
    one_layer = save_llama(tmp_path / "ckpt", layers=1)
    _fit_fails(
        one_layer,
        r"does not fit TinyLlama \(with pretrained_prefix='model.', the prefix its keys suggest\); nothing was"
        r" loaded. Missing from the checkpoint: model.model.layers.1.self_attn.q_proj.weight",
        pretrained_prefix=None,
    )
    causal_lm = save_llama(tmp_path / "two")
    with pytest.raises(ValueError, match=r"\(with pretrained_prefix=\{'model.': ''\}, the prefix its keys suggest\)"):
        load_pretrained(_meta_llama().model.model, causal_lm)  # a LlamaModel: lm_head.weight has no place


def test_a_wrong_prefix_given_suggests_the_right_one(tmp_path):
    directory = save_llama(tmp_path / "ckpt")
    model = _meta_llama()
    with pytest.raises(ValueError, match=r"\(with pretrained_prefix='model.'\).*as they are: leave out pretrained_"):
        load_pretrained(model.model, directory, prefix="model.")  # the inner LlamaForCausalLM: the files' own keys
    with pytest.raises(ValueError, match=r"\(with pretrained_prefix='net.'\).*try pretrained_prefix='model.'"):
        load_pretrained(_meta_llama(), directory, prefix="net.")


def test_path_that_does_not_exist():
    with pytest.raises(FileNotFoundError, match=r"pretrained='/no/such/dir' does not exist. Allowed: a .safetensors"):
        LowPrecisionStrategy(pretrained="/no/such/dir")


def test_directory_with_weights_in_a_format_not_read(tmp_path):
    """pytorch_model.bin is read (test_torch_bin.py); Meta's consolidated.00.pth is not, and is named."""
    torch.save({}, tmp_path / "consolidated.00.pth")
    with pytest.raises(FileNotFoundError, match=r"holds no model.safetensors.*consolidated.00.pth: convert them"):
        LowPrecisionStrategy(pretrained=tmp_path)


def test_index_naming_absent_shards(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "shard-1.safetensors"}}))
    with pytest.raises(FileNotFoundError, match=r"not in .*: shard-1.safetensors. .*fetch every file the index names"):
        LowPrecisionStrategy(pretrained=tmp_path)


def test_prefix_without_pretrained_and_bad_prefix_type(tmp_path):
    with pytest.raises(ValueError, match=r"pretrained_prefix='model.' was given without pretrained="):
        LowPrecisionStrategy(pretrained_prefix="model.")
    directory = save_llama(tmp_path / "ckpt")
    with pytest.raises(TypeError, match=r"pretrained_prefix=\['model.'\] must be a string"):
        LowPrecisionStrategy(pretrained=directory, pretrained_prefix=["model."])


def test_module_built_with_real_weights(tmp_path):
    directory = save_llama(tmp_path / "ckpt")
    _fit_fails(directory, r"needs TinyLlama built without weights, but its parameters are real", model=tiny_llama())


def test_meta_module_without_pretrained():
    trainer = quiet_trainer(strategy=LowPrecisionStrategy(), max_steps=1)
    with pytest.raises(ValueError, match=r"TinyLlama has parameters on the meta device and nothing to fill them"):
        trainer.fit(_meta_llama(), ids_loader(batches=1))


def test_meta_buffers_that_no_checkpoint_holds(tmp_path):
    directory = save_llama(tmp_path / "ckpt")
    with torch.device("meta"):
        model = tiny_llama()
    _fit_fails(directory, r"still on the meta device and in no checkpoint file: model.model.rotary_emb.inv_freq", model)


def test_ddp_strategy_takes_the_same_arguments(tmp_path):
    from pl_lowprec import LowPrecisionDDPStrategy

    with pytest.raises(FileNotFoundError, match=r"pretrained='/no/such/dir' does not exist"):
        LowPrecisionDDPStrategy(pretrained="/no/such/dir")
    directory = save_llama(tmp_path / "ckpt")
    strategy = LowPrecisionDDPStrategy(pretrained=directory, pretrained_prefix="model.")
    assert strategy.transform.weights.prefix == "model."


def test_an_offline_hub_id_names_the_library_error_briefly_cut_at_a_word(monkeypatch):
    """The hub's connection errors run to pages; the refusal keeps their first words, whole, on one line."""
    import huggingface_hub

    from pl_lowprec.loading.hub import resolve_pretrained

    def offline(*args, **kwargs):
        raise ConnectionError("Cannot reach huggingface.co: [Errno -2] Name or service not known\n" + "detail " * 100)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ValueError) as refused:
        resolve_pretrained("org/model")
    said = str(refused.value)
    assert "failed (ConnectionError: Cannot reach huggingface.co: [Errno -2] Name or service not known detail" in said
    assert "detail ...). Download it on a machine with network access (`hf download org/model" in said
    assert "\n" not in said


def test_a_directory_without_tokenizer_files_is_named_as_such(tmp_path):
    """Only config.json (the shapes a meta-device estimate reads): not transformers' 'install sentencepiece'."""
    from pl_lowprec.loading.tokenizer import load_tokenizer

    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match=r"holds no tokenizer file \(tokenizer.json, tokenizer_config.json, .*it is"):
        load_tokenizer(tmp_path)
