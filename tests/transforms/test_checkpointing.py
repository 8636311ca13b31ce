"""set_activation_checkpointing: same gradients, fewer saved bytes, unchanged names and keys."""

import copy

import pytest
import torch

from pl_lowprec import remove_activation_checkpointing, set_activation_checkpointing
from pl_lowprec.demo.tiny_gpt import Block, TinyGPT
from pl_lowprec.memory.activations import count_saved_tensors
from pl_lowprec.transforms.checkpointing import CheckpointedForward


def _gpt(layers=8):
    torch.manual_seed(0)
    return TinyGPT(dim=32, layers=layers, heads=2, max_len=64)


def _llama(layers, num_attention_heads=2, **kwargs):
    """A seeded tiny Hugging Face Llama (2 key/value heads)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=2,
        max_position_embeddings=64,
        **kwargs,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _ids():
    return torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1))


def _saved_bytes(model):
    with count_saved_tensors(model) as counter:
        model._loss({"input_ids": _ids()}).backward()
    return counter.nbytes


def _grads(model, ids):
    model.zero_grad()
    model._loss({"input_ids": ids}).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_checkpointing_everything_halves_saved_bytes_and_every_other_less():
    plain = _saved_bytes(_gpt())
    every = _gpt()
    set_activation_checkpointing(every, Block)
    half = _gpt()
    set_activation_checkpointing(half, "Block", every_n=2)
    every_bytes, half_bytes = _saved_bytes(every), _saved_bytes(half)
    assert every_bytes <= 0.5 * plain
    assert every_bytes < half_bytes < plain


@pytest.mark.parametrize("impl", ["non_reentrant", "reentrant"])
def test_gradients_are_identical(impl):
    plain, ckpt = _gpt(4), _gpt(4)
    set_activation_checkpointing(ckpt, lambda module, name: isinstance(module, Block), impl=impl)
    ids = _ids()
    expected, actual = _grads(plain, ids), _grads(ckpt, ids)
    assert expected.keys() == actual.keys()
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name])


def test_reentrant_with_frozen_embeddings_still_trains_the_blocks():
    plain, ckpt = _gpt(2), _gpt(2)
    for model in (plain, ckpt):
        model.embed.requires_grad_(False)
        model.pos.requires_grad_(False)
    set_activation_checkpointing(ckpt, Block, impl="reentrant")
    ids = _ids()
    expected, actual = _grads(plain, ids), _grads(ckpt, ids)
    assert "blocks.0.mlp.0.weight" in actual  # the "does not require grad" trap would leave this None
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name])


def test_names_keys_and_types_are_unchanged_and_idempotent():
    model = _gpt(4)
    keys, names = list(model.state_dict()), [n for n, _ in model.named_parameters()]
    set_activation_checkpointing(model, Block)
    set_activation_checkpointing(model, Block)  # a second call wraps nothing twice
    assert list(model.state_dict()) == keys and [n for n, _ in model.named_parameters()] == names
    assert all(isinstance(b, Block) for b in model.blocks)
    assert not isinstance(model.blocks[0].forward.forward, CheckpointedForward)
    plain = copy.deepcopy(model)
    remove_activation_checkpointing(plain)
    assert "forward" not in plain.blocks[0].__dict__


def test_unknown_class_name_lists_the_model_classes():
    with pytest.raises(ValueError, match=r"'LlamaDecoderLayer' matches no module of TinyGPT.*Block, Embedding"):
        set_activation_checkpointing(_gpt(2), ["Block", "LlamaDecoderLayer"])


def test_predicate_that_selects_nothing_is_an_error():
    with pytest.raises(ValueError, match="matches no module"):
        set_activation_checkpointing(_gpt(2), lambda module, name: False)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_invalid_every_n(bad):
    with pytest.raises(ValueError, match=rf"checkpoint_every_n={bad!r} is not valid: use an integer >= 1"):
        set_activation_checkpointing(_gpt(2), Block, every_n=bad)


def test_hugging_face_llama_decoder_layers():
    plain = _llama(layers=4)
    ckpt = copy.deepcopy(plain)
    assert set_activation_checkpointing(ckpt, "LlamaDecoderLayer") == [f"model.layers.{i}" for i in range(4)]
    ids = _ids()

    def run(model):
        with count_saved_tensors(model) as counter:
            model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        return counter.nbytes, {n: p.grad for n, p in model.named_parameters()}

    plain_bytes, expected = run(plain)
    ckpt_bytes, actual = run(ckpt)
    assert ckpt_bytes <= 0.5 * plain_bytes
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name])


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_a_model_called_with_its_kv_cache_trains_as_without_it(mode, caplog, monkeypatch):
    """``model(input_ids=..., labels=...)`` as a module's training_step writes it: the config's use_cache=True makes a
    DynamicCache, which a recompute wrote twice (selective checkpointing stopped at the first backward). Each
    checkpointed layer runs without it, as transformers' gradient checkpointing does, and says so once."""
    import logging

    from pl_lowprec.transforms import checkpoint_cache

    monkeypatch.setattr(checkpoint_cache, "_said", False)
    plain = _llama(layers=3, num_attention_heads=4, use_cache=True)  # GQA: 2 key/value heads
    ckpt = copy.deepcopy(plain)
    set_activation_checkpointing(ckpt, "LlamaDecoderLayer", mode=mode)
    ids = _ids()
    plain(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        for _ in range(2):
            ckpt.zero_grad()
            out = ckpt(input_ids=ids, labels=ids)  # the config's use_cache=True
            out.loss.backward()
    assert out.past_key_values is None or out.past_key_values.get_seq_length() == 0  # no layer wrote it
    for (name, expected), actual in zip(plain.named_parameters(), ckpt.parameters(), strict=True):
        torch.testing.assert_close(actual.grad, expected.grad, msg=name)
    said = [r.getMessage() for r in caplog.records if "with a KV cache" in r.getMessage()]
    assert len(said) == 1 and "each checkpointed LlamaDecoderLayer runs without it" in said[0]
