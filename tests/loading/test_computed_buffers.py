"""Checkpoints of older transformers hold copies of buffers the model computes (``rotary_emb.inv_freq`` in every
layer, ``position_ids``): ``from_pretrained`` leaves them unread, and so does the streamed load, saying so. They
were refused as keys "not in the module", with no way to load the checkpoint short of rewriting it."""

from __future__ import annotations

import logging

import pytest
import torch
from loading_helpers import LlamaModule, rewrite_weights, save_llama

from pl_lowprec.loading import empty_weights, load_pretrained
from pl_lowprec.loading.key_match import CheckpointMismatch

pytest.importorskip("transformers")


def _with_extra(directory, extra: dict[str, torch.Tensor]):
    return rewrite_weights(directory, lambda state: {**state, **extra})


def _meta_module() -> LlamaModule:
    with empty_weights():
        return LlamaModule(hidden_size=32, layers=2)


def test_old_per_layer_rotary_frequencies_are_left_unread_and_said(tmp_path, caplog):
    from transformers import AutoModelForCausalLM

    directory = save_llama(tmp_path / "ckpt", hidden_size=32, layers=2)
    old = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(4) for i in range(2)}
    _with_extra(directory, old)
    module = _meta_module()
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        load_pretrained(module, directory, "model.")
    said = [r.getMessage() for r in caplog.records if "left unread" in r.getMessage()]
    assert said and "2 tensor(s) left unread" in said[0] and "rotary_emb.inv_freq" in said[0], said
    reference = AutoModelForCausalLM.from_pretrained(directory)
    for key, value in reference.state_dict().items():
        assert torch.equal(module.model.state_dict()[key], value), key
    assert not torch.equal(module.model.model.rotary_emb.inv_freq, torch.ones(4))  # its own, computed


def test_a_key_the_model_neither_holds_nor_computes_is_still_refused_with_the_fix(tmp_path):
    directory = save_llama(tmp_path / "ckpt", hidden_size=32, layers=2)
    _with_extra(directory, {"model.extra.weight": torch.ones(4)})
    with pytest.raises(CheckpointMismatch, match=r"not in the module: model.model.extra.weight. .*save_pretrained"):
        load_pretrained(_meta_module(), directory, "model.")
