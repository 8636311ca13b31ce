"""``CausalLM(pretrained=...)`` of a checkpoint that is not a causal LM (a sequence classifier, an encoder-decoder)
is refused by ``fit``, ``estimate`` and ``plan`` as one paragraph naming the checkpoint's class, before anything
is built or written.

``estimate`` and ``plan`` used to estimate a BERT classifier as the ``BertLMHeadModel`` AutoModelForCausalLM makes
of its config, and ``fit`` refused it only once the weights streamed in, as lists of missing and unexpected keys.
The commands run in-process, the user's way (``pl_lowprec.cli.main`` with the command's arguments).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from loading_helpers import causal_lm_fit_args, save_tokenizer, write_prompt_completion

from pl_lowprec.cli import main

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

FINETUNE = str(Path(__file__).resolve().parents[2] / "configs/finetune-causal-lm.yaml")


def bert_classifier(directory: Path) -> Path:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
    BertForSequenceClassification(config).save_pretrained(directory)
    return save_tokenizer(directory)


def t5(directory: Path) -> Path:
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(d_model=32, d_kv=16, d_ff=64, num_layers=1, num_heads=2)
    T5ForConditionalGeneration(config).save_pretrained(directory)
    return save_tokenizer(directory)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("not_causal")
    data = write_prompt_completion(tmp / "pc.jsonl", 8)
    return {"bert": bert_classifier(tmp / "bert"), "t5": t5(tmp / "t5")}, data


def command(name: str, pretrained: Path, data: Path, tmp: Path) -> list[str]:
    root = f"--trainer.default_root_dir={tmp / 'runs'}"
    if name == "fit":
        return [*causal_lm_fit_args(pretrained, data), root, "--trainer.max_steps=1"]
    user = [f"--model.pretrained={pretrained}", f"--data.train_files={data}", f"--data.val_files={data}"]
    user += [f"--data.tokenizer={pretrained}", root]
    extra = ["--memory=1GiB", f"--out={tmp / 'plan.yaml'}"] if name == "plan" else []
    return [name, f"--config={FINETUNE}", *user, *extra]


@pytest.mark.parametrize("model", ["bert", "t5"])
@pytest.mark.parametrize("name", ["fit", "estimate", "plan"])
def test_a_model_that_is_not_a_causal_lm_is_refused_naming_its_class(capsys, tmp_path, files, name, model):
    directories, data = files
    with pytest.raises(SystemExit) as exited:
        main(command(name, directories[model], data, tmp_path))
    out, err = capsys.readouterr()
    assert exited.value.code == 2, (out + err)[-3000:]
    assert "Traceback" not in out + err
    assert out == ""
    paragraph = next(line for line in err.splitlines() if "error: " in line)
    kind = {"bert": "BertForSequenceClassification", "t5": "T5ForConditionalGeneration"}[model]
    assert f"is a {kind}" in paragraph and "not a causal LM" in paragraph, paragraph
    assert "write a LightningModule that builds it" in paragraph, paragraph
    assert not list(tmp_path.iterdir()), "nothing is written before the refusal"
