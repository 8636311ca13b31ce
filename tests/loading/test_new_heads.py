"""pretrained= a causal LM's checkpoint into a classifier of the user's own, as from_pretrained loads it: the new
head (LoRA task_type SEQ_CLS: modules_to_save) starts from its own initialization and trains; the checkpoint's
lm_head is left unread. Without a new head named, the same load is refused, saying which heads differ."""

from __future__ import annotations

import json
import logging

import lightning.pytorch as pl
import pytest
import torch
from lightning_helpers import quiet_trainer
from loading_helpers import LlamaModule, llama_config, save_llama
from qlora_helpers import ids_loader
from safetensors.torch import load_file

from pl_lowprec import LowPrecisionStrategy

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")


class Classifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        from transformers import LlamaForSequenceClassification

        self.model = LlamaForSequenceClassification(llama_config(num_labels=3, pad_token_id=0))

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"].clamp(min=1)  # 0 is the padding token
        return self.model(input_ids=ids, labels=ids[:, 0] % 2).loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


def _fit(directory, lora, quantization="nf4"):
    trainer = quiet_trainer(
        strategy=LowPrecisionStrategy(pretrained=directory, quantization=quantization, lora=lora), max_steps=2
    )
    with trainer.init_module(empty_init=True):
        model = Classifier()
    trainer.fit(model, ids_loader(batches=2))
    return trainer, model


def test_a_classifier_loads_a_causal_lm_checkpoint_and_trains_its_new_head(tmp_path, caplog):
    directory = save_llama(tmp_path / "causal_lm")
    torch.manual_seed(0)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        trainer, model = _fit(directory, {"r": 4, "task_type": "SEQ_CLS"})
    assert trainer.global_step == 2
    took = [r.getMessage() for r in caplog.records if "took pretrained_prefix" in r.getMessage()]
    assert len(took) == 1 and "matches Classifier's but for the heads named next (name" in took[0]
    said = [r.getMessage() for r in caplog.records if "a new head that trains whole" in r.getMessage()]
    assert said == [
        f"pretrained={str(directory)!r}: model.score.weight not in the checkpoint, a new head that trains whole"
        " (modules_to_save): initialized by its module's reset_parameters; of the checkpoint, model.lm_head.weight"
        " not used."
    ]
    original = load_file(directory / "model.safetensors")
    for key in ("model.norm.weight", "model.embed_tokens.weight"):  # the base, as the checkpoint holds it
        torch.testing.assert_close(model.model.get_parameter(key).float(), original[key], rtol=0, atol=0)
    score = model.model.score
    assert torch.isfinite(score.original_module.weight).all()
    assert not torch.equal(score.modules_to_save["default"].weight, score.original_module.weight)  # it trained


def test_without_a_new_head_named_the_load_is_refused_naming_the_heads(tmp_path):
    directory = save_llama(tmp_path / "causal_lm")
    with pytest.raises(ValueError, match=r"Only the heads differ: model.score is a new head.*task_type 'SEQ_CLS'"):
        _fit(directory, {"r": 4})


@pytest.mark.parametrize("shard_size", [None, "40KB"])
def test_a_merged_classifier_loads_with_transformers_and_computes_as_it_trained(tmp_path, shard_size):
    """Also from a sharded checkpoint: the new head goes into the last shard, and into the index's weight_map,
    which no longer names the head left out."""
    from transformers import AutoModelForSequenceClassification

    from pl_lowprec.export.merged import merge_into_pretrained
    from pl_lowprec.loading import PretrainedWeights

    # untied: its lm_head.weight is a head the classifier lacks
    directory = save_llama(tmp_path / "causal_lm", max_shard_size=shard_size)
    torch.manual_seed(0)
    _, model = _fit(directory, {"r": 4, "task_type": "SEQ_CLS"}, quantization=None)  # merged = what trained
    out = tmp_path / "merged"
    out.mkdir()
    counts = merge_into_pretrained(model, PretrainedWeights(directory, prefix="model."), out)
    assert counts["whole"] == 1 and counts["left_out"] == 1  # score.weight written, lm_head.weight left out
    merged = AutoModelForSequenceClassification.from_pretrained(out)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForSequenceClassification"]
    assert merged.config.num_labels == 3 and merged.config.pad_token_id == 0  # the classifier's, not the LM's
    if shard_size is None:
        assert "lm_head.weight" not in load_file(out / "model.safetensors")
    else:
        weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
        last = sorted(set(weight_map.values()))[-1]
        assert weight_map["score.weight"] == last and "lm_head.weight" not in weight_map
        assert len(set(weight_map.values())) > 2 and "score.weight" in load_file(out / last)
    ids = torch.randint(1, 256, (3, 12), generator=torch.Generator().manual_seed(1))
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, model.model(input_ids=ids).logits)


def _assert_merged_computes_as_trained(out, model):
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, model.model(input_ids=ids).logits)


@pytest.mark.parametrize("tie", [False, True])
def test_a_head_trained_whole_replaces_its_weight_in_the_merged_model(tmp_path, tie):
    """``modules_to_save=["lm_head"]``: its trained tensor replaces the checkpoint's, or, where the config ties it
    to the embeddings (no lm_head key), is added and ``tie_word_embeddings`` set false: the trained model is
    untied, and transformers would tie it back."""

    from pl_lowprec.export.merged import merge_into_pretrained
    from pl_lowprec.loading import PretrainedWeights

    directory = save_llama(tmp_path / "causal_lm", tie=tie)
    trainer = quiet_trainer(
        strategy=LowPrecisionStrategy(pretrained=directory, lora={"r": 4, "modules_to_save": ["lm_head"]}), max_steps=2
    )
    with trainer.init_module(empty_init=True):
        model = LlamaModule(tie=tie)
    trainer.fit(model, ids_loader(batches=2))
    out = tmp_path / "merged"
    out.mkdir()
    counts = merge_into_pretrained(model, PretrainedWeights(directory, prefix="model."), out)
    assert (counts["whole"], counts["left_out"]) == (1, 0)
    trained = model.model.lm_head.modules_to_save["default"].weight
    original = load_file(directory / "model.safetensors")
    assert not torch.equal(trained, original["model.embed_tokens.weight" if tie else "lm_head.weight"])  # it trained
    torch.testing.assert_close(load_file(out / "model.safetensors")["lm_head.weight"], trained.detach())
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    _assert_merged_computes_as_trained(out, model)


def test_embeddings_trained_whole_untie_the_head_which_the_merged_model_keeps_apart(tmp_path, caplog):
    """``modules_to_save=["embed_tokens"]`` under tied embeddings: peft trains a copy, and the tied head keeps the
    original rows. The LoRA line says so, and the merged model holds that head as its own tensor with
    ``tie_word_embeddings`` false (tied again, it ran the trained rows as the head too)."""

    from pl_lowprec.export.merged import merge_into_pretrained
    from pl_lowprec.loading import PretrainedWeights

    directory = save_llama(tmp_path / "causal_lm", tie=True)
    strategy = LowPrecisionStrategy(pretrained=directory, lora={"r": 4, "modules_to_save": ["embed_tokens"]})
    trainer = quiet_trainer(strategy=strategy, max_steps=2)
    with trainer.init_module(empty_init=True):
        model = LlamaModule(tie=True)
    with caplog.at_level(logging.INFO, logger="lightning.pytorch.utilities.rank_zero"):
        trainer.fit(model, ids_loader(batches=2))
    untied = "model.lm_head, tied to model.model.embed_tokens, keeps the original rows: peft trains a copy"
    assert any(untied in r.getMessage() for r in caplog.records)
    out = tmp_path / "merged"
    out.mkdir()
    counts = merge_into_pretrained(model, PretrainedWeights(directory, prefix="model."), out)
    assert counts["whole"] == 2  # the trained embeddings, and the head apart from them
    original = load_file(directory / "model.safetensors")["model.embed_tokens.weight"]
    written = load_file(out / "model.safetensors")
    assert not torch.equal(written["model.embed_tokens.weight"], original)
    assert torch.equal(written["lm_head.weight"], original)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    _assert_merged_computes_as_trained(out, model)


def test_a_weight_trained_outside_the_pretrained_model_is_refused_naming_it(tmp_path):
    from pl_lowprec.export.trained_whole import file_key_of

    assert file_key_of("model.score.weight", "model.", tmp_path) == "score.weight"
    assert file_key_of("net.score.weight", {"": "net."}, tmp_path) == "score.weight"
    with pytest.raises(ValueError, match=r"extra.weight trained whole .* under pretrained_prefix='model.' no checkp"):
        file_key_of("extra.weight", "model.", tmp_path)
