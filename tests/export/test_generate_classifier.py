"""A classifier of the user's own (LoRA task_type SEQ_CLS on a causal LM's checkpoint) through fit, export and
generate: the merged export loads as the classifier it trained, and generate refuses each of its forms, from the
checkpoint, the merged directory and the adapter, before anything loads (transformers would load the merged one as
a causal LM and generate from the untouched base)."""

from __future__ import annotations

import json

import pytest
from loading_helpers import save_llama
from own_module_helpers import write_own_config, write_own_module

from pl_lowprec.cli import main

pytest.importorskip("peft")

OWN_CLASSIFIER = """
import lightning as L
import torch
from transformers import AutoConfig, AutoModelForSequenceClassification


class MyClassifier(L.LightningModule):
    def __init__(self, config_dir: str):
        super().__init__()
        self.model = AutoModelForSequenceClassification.from_config(
            AutoConfig.from_pretrained(config_dir, num_labels=3, pad_token_id=0)
        )

    def training_step(self, batch, batch_idx):
        ids = batch.clamp(min=1)
        return self.model(input_ids=ids, labels=ids[:, 0] % 3).loss

    def configure_optimizers(self):
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)


class Ids(L.LightningDataModule):
    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0)))
"""


@pytest.fixture
def trained(tmp_path, monkeypatch):
    pretrained = save_llama(tmp_path / "pretrained")
    write_own_module(tmp_path, "own_classifier", OWN_CLASSIFIER, monkeypatch)
    strategy = {"lora": {"r": 4, "task_type": "SEQ_CLS"}}
    write_own_config(tmp_path / "cls.yaml", "own_classifier.MyClassifier", "own_classifier.Ids", pretrained, strategy)
    main(["fit", "--config", "cls.yaml"])
    (checkpoint,) = tmp_path.glob("runs/lightning_logs/version_0/checkpoints/*.ckpt")
    return checkpoint


def test_a_classifier_exports_merged_and_generate_refuses_each_of_its_forms(trained, tmp_path, capsys, monkeypatch):
    from transformers import AutoModelForSequenceClassification

    main(["export", "--ckpt_path", str(trained), "--out", "merged", "--merged"])
    assert "1 as they trained, 1 of a head the model lacks left out" in capsys.readouterr().out
    merged = AutoModelForSequenceClassification.from_pretrained(tmp_path / "merged")
    assert merged.config.num_labels == 3 and merged.score.weight.abs().sum() > 0
    main(["export", "--ckpt_path", str(trained), "--out", "adapter"])
    assert json.loads((tmp_path / "adapter/adapter_config.json").read_text())["task_type"] == "SEQ_CLS"
    (tmp_path / "prompts.txt").write_text("def f(x):\n")
    refusals = {
        "merged": "--model 'merged' is a LlamaForSequenceClassification (config.json's architectures), which scores"
        " text and has no generate(): pl-lowprec generate completes prompts with a causal LM",
        "adapter": "--model 'adapter' is a peft adapter for task_type 'SEQ_CLS', which scores text",
    }
    for directory, said in refusals.items():
        with pytest.raises(SystemExit):
            main(["generate", "--model", directory, "--prompts", "prompts.txt", "--out", "out.jsonl"])
        assert said in " ".join(capsys.readouterr().err.split())
    monkeypatch.setattr("pl_lowprec.cli.generate.restore", lambda *a: pytest.fail("restored before the refusal"))
    with pytest.raises(SystemExit):
        main(["generate", "--ckpt_path", str(trained), "--prompts", "prompts.txt", "--out", "out.jsonl"])
    err = " ".join(capsys.readouterr().err.split())
    assert "MyClassifier holds a LlamaForSequenceClassification, which scores text and has no generate()" in err
    assert "Traceback" not in err and not (tmp_path / "out.jsonl").exists()
    monkeypatch.setattr("pl_lowprec.cli.export.restore", lambda *a: pytest.fail("restored before the refusal"))
    with pytest.raises(SystemExit):
        main(["export", "--ckpt_path", str(trained), "--out", "gguf", "--format", "gguf"])
    err = " ".join(capsys.readouterr().err.split())
    assert "LlamaForSequenceClassification, which scores text and has no generate(): a GGUF file holds a causal" in err
    assert not (tmp_path / "gguf").exists()


def test_a_causal_lm_directory_still_generates_past_the_check(tmp_path):
    from pl_lowprec.export.generates_text import check_directory_generates

    directory = save_llama(tmp_path / "causal_lm")
    check_directory_generates(directory)  # LlamaForCausalLM: no refusal
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | {"architectures": ["LlamaForTokenClassification"]}))
    with pytest.raises(ValueError, match="is a LlamaForTokenClassification"):
        check_directory_generates(directory)
