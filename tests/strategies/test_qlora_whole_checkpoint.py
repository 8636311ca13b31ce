"""A QLoRA run saved whole (``adapter_only_checkpoint=False``) resumes and validates from its checkpoint: the
4-bit base comes back with the constants bitsandbytes saved beside each packed weight (``weight.absmax``,
``weight.quant_map``, ``weight.quant_state.bitsandbytes__nf4``, ...), which torch's ``load_state_dict`` refused as
42 unexpected keys. int8 layers read their own ``SCB`` and are the reference that always loaded."""

from __future__ import annotations

import pytest
import torch
from lightning_helpers import quiet_trainer
from loading_helpers import LLAMA_LORA as LORA
from loading_helpers import ValidatedLlama, save_llama
from qlora_helpers import LossRecorder, ids_loader

from pl_lowprec import LowPrecisionStrategy
from pl_lowprec.adapters import CheckpointMismatch, merged_state_dict
from pl_lowprec.export.restore import restore

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")


def _strategy(pretrained, quantization) -> LowPrecisionStrategy:
    return LowPrecisionStrategy(
        pretrained=pretrained, lora=LORA, quantization=quantization, adapter_only_checkpoint=False
    )


def _fit(pretrained, quantization, max_steps, ckpt_path=None, save_to=None):
    """``max_steps`` epochs of one batch from ``pretrained`` (resumed from ``ckpt_path``); the module and its losses."""
    torch.manual_seed(0)  # the LoRA A matrices
    losses = LossRecorder()
    strategy = _strategy(pretrained, quantization)
    trainer = quiet_trainer(strategy=strategy, max_steps=max_steps, callbacks=[losses], num_sanity_val_steps=0)
    with trainer.init_module(empty_init=True):
        model = ValidatedLlama(hidden_size=64)
    trainer.fit(model, ids_loader(batches=1), ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return trainer, model, losses.losses


@pytest.mark.parametrize("quantization", ["nf4", "nf4-dq", "int8"])
def test_a_whole_qlora_checkpoint_resumes_as_the_uninterrupted_run(tmp_path, quantization):
    pretrained = save_llama(tmp_path / "base", hidden_size=64)
    _, uninterrupted, losses = _fit(pretrained, quantization, max_steps=2)
    _, _, first = _fit(pretrained, quantization, max_steps=1, save_to=tmp_path / "step1.ckpt")
    _, resumed, rest = _fit(pretrained, quantization, max_steps=2, ckpt_path=tmp_path / "step1.ckpt")
    assert first + rest == losses
    expected, got = uninterrupted.state_dict(), resumed.state_dict()
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[key], got[key]) for key in expected)


def test_validate_takes_the_saved_4bit_base_not_the_pretrained_one(tmp_path):
    """``validate(ckpt_path=)`` gives the metric of the model as it trained, even where ``pretrained=`` now holds
    other weights: the checkpoint's packed weights and constants are the base (``Params4bit.from_prequantized``)."""
    trainer, model, _ = _fit(save_llama(tmp_path / "base", hidden_size=64), "nf4", 2, save_to=tmp_path / "w.ckpt")
    (trained,) = trainer.validate(model, ids_loader(batches=2, seed=1), verbose=False)
    other = save_llama(tmp_path / "other", seed=2, hidden_size=64)
    trainer = quiet_trainer(strategy=_strategy(other, "nf4"))
    with trainer.init_module(empty_init=True):
        restored = ValidatedLlama(hidden_size=64)
    (metrics,) = trainer.validate(restored, ids_loader(batches=2, seed=1), ckpt_path=tmp_path / "w.ckpt", verbose=False)
    assert metrics == trained
    with pytest.raises(CheckpointMismatch, match=r"q_proj\.base_layer\.weight has quant_type nf4 in the checkpoint"):
        trainer = quiet_trainer(strategy=_strategy(other, "fp4"))
        with trainer.init_module(empty_init=True):
            restored = ValidatedLlama(hidden_size=64)
        trainer.validate(restored, ids_loader(batches=1), ckpt_path=tmp_path / "w.ckpt", verbose=False)


def test_the_export_restores_a_whole_qlora_checkpoint(tmp_path):
    """``pl-lowprec export --ckpt_path`` restores through the same load (``export.restore``): the merged weights are
    the trained module's (it refused the checkpoint with the 42 unexpected keys)."""
    pretrained = save_llama(tmp_path / "base", hidden_size=64)
    _, trained, _ = _fit(pretrained, "nf4", 1, save_to=tmp_path / "w.ckpt")
    trainer = quiet_trainer(strategy=_strategy(pretrained, "nf4"))
    with trainer.init_module(empty_init=True):
        module = ValidatedLlama(hidden_size=64)
    restored = restore(tmp_path / "w.ckpt", trainer, module)
    expected, got = merged_state_dict(trained), merged_state_dict(restored.module)
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[key], got[key]) for key in expected)


@pytest.mark.parametrize(
    ("quantization", "refusal"),
    [
        ("int8", r"int8 layer model\.model\.layers\.0\.self_attn\.q_proj\.base_layer has a float32 weight and no SCB"),
        ("nf4", r"q_proj\.base_layer\.weight: \[64, 64\] in the checkpoint, \[2048, 1\] in the model"),
    ],
)
def test_a_whole_checkpoint_saved_unquantized_is_refused_by_a_quantized_config(tmp_path, quantization, refusal):
    """A float weight into an int8 layer was cast silently, beside the ``SCB`` of what the layer held (quantized
    from empty storage, as the checkpoint sets every weight: val_loss nan; before, from pretrained=: a wrong loss).
    A 4-bit layer refuses it by its packed shape."""
    pretrained = save_llama(tmp_path / "base", hidden_size=64)
    _fit(pretrained, None, 1, save_to=tmp_path / "w.ckpt")
    trainer = quiet_trainer(strategy=_strategy(pretrained, quantization))
    with trainer.init_module(empty_init=True):
        restored = ValidatedLlama(hidden_size=64)
    with pytest.raises(CheckpointMismatch, match=refusal):
        trainer.validate(restored, ids_loader(batches=1), ckpt_path=tmp_path / "w.ckpt", verbose=False)


@pytest.mark.parametrize("stripped", ["model.model.layers.0.self_attn.q_proj.base_layer.weight.", ".weight."])
def test_packed_weights_without_their_constants_are_refused(tmp_path, stripped):
    """Packed bytes have the layer's packed shape: torch copied them in, read with the constants the layer computed
    from its empty storage (one layer's constants missing, or all of them)."""
    pretrained = save_llama(tmp_path / "base", hidden_size=64)
    _fit(pretrained, "nf4", 1, save_to=tmp_path / "w.ckpt")
    saved = torch.load(tmp_path / "w.ckpt", weights_only=False)
    beside = ("absmax", "quant_map", "quant_state.")
    saved["state_dict"] = {
        key: value
        for key, value in saved["state_dict"].items()
        if not (stripped in key and key.rsplit(".weight.", 1)[-1].startswith(beside))
    }
    torch.save(saved, tmp_path / "stripped.ckpt")
    trainer = quiet_trainer(strategy=_strategy(pretrained, "nf4"))
    with trainer.init_module(empty_init=True):
        restored = ValidatedLlama(hidden_size=64)
    with pytest.raises(CheckpointMismatch, match=r"q_proj\.base_layer\.weight is in the checkpoint without the const"):
        trainer.validate(restored, ids_loader(batches=1), ckpt_path=tmp_path / "stripped.ckpt", verbose=False)
