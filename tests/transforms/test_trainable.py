"""quantization= without lora= trains only what is not quantized: one line says what, of how many parameters,
on both paths (a model quantized in memory, and pretrained weights quantized as they stream in)."""

from __future__ import annotations

import json

import pytest
from lightning_helpers import quiet_trainer
from loading_helpers import save_pretrained_dir
from qlora_helpers import ids_loader, tiny_llama

from pl_lowprec import LowPrecisionStrategy

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")


def said(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("lora is null")]


def test_a_quantized_model_without_lora_says_what_trains(caplog):
    model = tiny_llama(hidden_size=64)
    total = sum(p.numel() for p in tiny_llama(hidden_size=64).parameters())  # before any layer is quantized
    with caplog.at_level("INFO"):
        quiet_trainer(strategy=LowPrecisionStrategy(quantization="nf4"), max_steps=1).fit(model, ids_loader(batches=1))
    trainable = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    norms = sum(n for name, n in trainable.items() if "norm" in name)
    embeddings = trainable["model.model.embed_tokens.weight"]
    quantized = sum(type(m).__name__ == "Linear4bit" for m in model.modules())
    assert quantized == 14 and norms > 0
    assert said(caplog) == [
        f"lora is null: with quantization='nf4' the 14 quantized linear layers are frozen, and only"
        f" {sum(trainable.values()):,} of {total:,} parameters train: embeddings ({embeddings:,}), lm_head"
        f" ({trainable['model.lm_head.weight']:,}), norms ({norms:,}). Set lora= to train adapters on them (QLoRA)."
    ]
    caplog.clear()
    with caplog.at_level("INFO"):
        strategy = LowPrecisionStrategy(quantization="nf4", lora={"r": 4})
        quiet_trainer(strategy=strategy, max_steps=1).fit(tiny_llama(hidden_size=64), ids_loader(batches=1))
    assert said(caplog) == []  # with adapters, nothing to say


def test_pretrained_weights_quantized_as_they_stream_in_say_it_once(tmp_path, caplog):
    from pl_lowprec.data import TextDataModule
    from pl_lowprec.models import CausalLM

    pretrained = save_pretrained_dir(tmp_path / "model")
    data = tmp_path / "pc.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"x{i} =", "completion": f" {i}"}) for i in range(8)))
    datamodule = TextDataModule(train_files=str(data), tokenizer=str(pretrained), batch_size=4, val_fraction=0)
    model = CausalLM(str(pretrained))
    with caplog.at_level("INFO"):
        trainer = quiet_trainer(strategy=LowPrecisionStrategy(quantization="nf4-dq"), max_steps=1)
        trainer.fit(model, datamodule=datamodule)
    lines = said(caplog)
    assert len(lines) == 1, caplog.text
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert f"with quantization='nf4-dq' the 7 quantized linear layers are frozen, and only {trainable:,} of" in lines[0]
    assert "embeddings (" in lines[0] and "norms (" in lines[0]
