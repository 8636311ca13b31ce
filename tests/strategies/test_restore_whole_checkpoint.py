"""validate/test/predict (and a resumed fit) with ``ckpt_path=`` of a checkpoint holding every weight (no LoRA, or
``adapter_only_checkpoint=False``) read no pretrained file: the strategy streamed ``pretrained=`` (every tensor) and
then loaded the checkpoint over it, so every weight was read twice. The metrics are those of the trained model.

``lowprec_fsdp`` restored after its setup, which had streamed ``pretrained=`` into the shards; it now restores before
it as ``lowprec`` does, and the transform gives the model empty storage that the checkpoint fills (on several ranks,
each rank's rows: ``Sharding.empty_storage``). Its cases run in this process (a one-rank gloo group): the same
strategy, restore order and load as on several ranks, without spawning them."""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
from lightning_helpers import quiet_trainer
from loading_helpers import LLAMA_LORA as LORA
from loading_helpers import (
    ValidatedLlama,
    bin_copy,
    count_safetensors_opens,
    count_unpickles,
    save_llama,
)
from qlora_helpers import ids_loader

from pl_lowprec import LowPrecisionFSDPStrategy, LowPrecisionStrategy

pytest.importorskip("transformers")
pytest.importorskip("peft")

FSDP = functools.partial(LowPrecisionFSDPStrategy, shard_modules=["LlamaDecoderLayer"])


def _trained(pretrained, tmp_path, tie=False, make: Callable = LowPrecisionStrategy, **strategy):
    """Two steps from ``pretrained`` under ``make(...)``'s strategy; the checkpoint, and the validation loss of the
    model as it trained."""
    trainer = quiet_trainer(strategy=make(pretrained=pretrained, **strategy), max_steps=2)
    with trainer.init_module(empty_init=True):
        model = ValidatedLlama(hidden_size=64, tie=tie)
    trainer.fit(model, ids_loader(batches=2))
    checkpoint = tmp_path / "trained.ckpt"
    trainer.save_checkpoint(checkpoint)
    (metrics,) = trainer.validate(model, ids_loader(batches=2, seed=1), verbose=False)
    return checkpoint, metrics


def _validated(pretrained, checkpoint, tie=False, make: Callable = LowPrecisionStrategy, **strategy):
    trainer = quiet_trainer(strategy=make(pretrained=pretrained, **strategy))
    with trainer.init_module(empty_init=True):
        model = ValidatedLlama(hidden_size=64, tie=tie)
    (metrics,) = trainer.validate(model, ids_loader(batches=2, seed=1), ckpt_path=checkpoint, verbose=False)
    if tie:  # one tensor still, filled once
        assert model.model.lm_head.weight is model.model.model.embed_tokens.weight
    return metrics


@pytest.mark.parametrize(
    "strategy",
    [
        {},
        {"tie": True},
        {"lora": LORA, "adapter_only_checkpoint": False},
        {"lora": LORA, "quantization": "nf4", "adapter_only_checkpoint": False},
        {"lora": LORA, "quantization": "int8", "adapter_only_checkpoint": False},
        {"make": FSDP},
        {"make": FSDP, "lora": LORA, "adapter_only_checkpoint": False},
    ],
    ids=[
        "whole-model",
        "tied-whole-model",
        "lora-whole-checkpoint",
        "nf4-whole-checkpoint",
        "int8-whole-checkpoint",
        "fsdp-whole-model",
        "fsdp-lora-whole-checkpoint",
    ],
)
def test_validate_of_a_whole_checkpoint_reads_no_pretrained_file(tmp_path, monkeypatch, request, strategy):
    """With quantization= too: the layers quantized from empty storage get the checkpoint's packed weights and
    constants (4-bit: ``quantized_checkpoint.py``; int8: its ``SCB``)."""
    if "quantization" in strategy:
        pytest.importorskip("bitsandbytes")
    if strategy.get("make") is FSDP:  # its one-rank group, which Lightning leaves (conftest destroys it)
        request.getfixturevalue("no_process_group_left")
    pretrained = save_llama(tmp_path / "base", hidden_size=64, tie=strategy.get("tie", False))
    checkpoint, trained = _trained(pretrained, tmp_path, **strategy)
    opened = count_safetensors_opens(monkeypatch, pretrained)
    restored = _validated(pretrained, checkpoint, **strategy)
    assert opened == []  # the model file, opened for its headers and per module, before
    assert restored == trained


def test_validate_of_a_whole_checkpoint_unpickles_no_bin_base(tmp_path, monkeypatch):
    base = save_llama(tmp_path / "st", hidden_size=64)
    pretrained = bin_copy(base, tmp_path / "bin", shards=2)
    strategy = {"lora": LORA, "adapter_only_checkpoint": False}
    checkpoint, trained = _trained(pretrained, tmp_path, **strategy)
    loads = count_unpickles(monkeypatch)
    restored = _validated(pretrained, checkpoint, **strategy)
    assert [f for f in loads if str(f).endswith(".bin")] == []  # each shard once, before
    assert restored == trained


@pytest.mark.parametrize(
    "strategy",
    [
        {"lora": LORA},
        {"lora": {**LORA, "init_lora_weights": "pissa"}, "adapter_only_checkpoint": False},
        {"lora": {**LORA, "init_lora_weights": "olora"}, "quantization": "nf4", "adapter_only_checkpoint": False},
    ],
    ids=["adapter-only", "pissa-whole-checkpoint", "olora-nf4-whole-checkpoint"],
)
def test_a_checkpoint_that_needs_the_base_still_reads_it(tmp_path, monkeypatch, strategy):
    """An adapter-only checkpoint lacks the base; PiSSA computes its initial adapters from it (kept for the export),
    OLoRA also from a 4-bit layer, which must not be quantized from empty storage: pretrained= is read, as before."""
    if "quantization" in strategy:
        pytest.importorskip("bitsandbytes")
    pretrained = save_llama(tmp_path / "base", hidden_size=64)
    checkpoint, trained = _trained(pretrained, tmp_path, **strategy)
    opened = count_safetensors_opens(monkeypatch, pretrained)
    restored = _validated(pretrained, checkpoint, **strategy)
    assert "model.safetensors" in opened
    assert restored == trained
