"""make-demo-model writes a really pretrained Hugging Face directory; the fine-tuning config runs on it."""

import contextlib
import io
import json
import math

import pytest
import torch

from pl_lowprec.cli import build_cli, main

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")


PRINTED: dict[str, list[str]] = {}


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        main(["make-demo-model", str(out), "--steps", "150"])  # enough to learn the task in 40 steps
    PRINTED["lines"] = printed.getvalue().splitlines()
    return out


def test_it_says_its_progress_while_it_pretrains(demo):
    """A minute or more on 2 cores: a line at the start and at each tenth of the steps, then the summary."""
    first, *steps, last = PRINTED["lines"]
    assert first.startswith("Pre-training a 2-layer Llama (") and first.endswith("for 150 steps on Python's sources.")
    assert [line.split(":")[0] for line in steps] == [f"step {n}/150" for n in range(15, 151, 15)]
    assert last.startswith(f"Wrote {demo / 'model'} (")


def test_the_model_loads_as_any_hub_model_and_was_trained(demo):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(demo / "model")
    tokenizer = AutoTokenizer.from_pretrained(demo / "model")
    summary = json.loads((demo / "model" / "pretraining.json").read_text())
    assert summary["last_loss"] < summary["first_loss"] - 1.0  # it learned something of Python's sources
    ids = torch.tensor([tokenizer("def __init__(self):\n        self.")["input_ids"]])
    loss = model(input_ids=ids, labels=ids).loss
    assert loss < torch.log(torch.tensor(float(len(tokenizer))))  # better than uniform over the vocabulary
    assert tokenizer.chat_template is not None
    train = [json.loads(line) for line in (demo / "data" / "train.jsonl").read_text().splitlines()]
    val = [json.loads(line) for line in (demo / "data" / "val.jsonl").read_text().splitlines()]
    assert {r["prompt"] for r in train}.isdisjoint(r["prompt"] for r in val) and len(val) > 10


def test_finetune_config_runs_on_the_demo_model(demo, tmp_path):
    cli = build_cli(
        [
            "fit",
            "--config=configs/finetune-causal-lm.yaml",
            f"--model.pretrained={demo / 'model'}",
            f"--data.tokenizer={demo / 'model'}",
            f"--data.train_files={demo / 'data' / 'train.jsonl'}",
            f"--data.val_files={demo / 'data' / 'val.jsonl'}",
            "--trainer.plugins=[]",  # fp32 on this CPU: bf16 autocast is slower here than fp32
            "--trainer.precision=32-true",
            "--trainer.max_steps=4",
            "--trainer.val_check_interval=4",
            "--trainer.limit_val_batches=2",
            f"--trainer.default_root_dir={tmp_path}",
            "--trainer.enable_progress_bar=false",
        ]
    )
    assert cli.trainer.global_step == 4
    assert type(cli.model.model.model.layers[0].mlp.up_proj.base_layer).__name__ == "Linear4bit"

    # The same 2 validation batches through plain transformers: the pretrained demo model is far better than the
    # same config untrained (measured: perplexity 241 against 945-1130 for seeds 0-2; the vocabulary is 1024).
    from transformers import AutoConfig, AutoModelForCausalLM

    batches = [batch for _, batch in zip(range(2), cli.datamodule.val_dataloader(), strict=False)]
    pretrained = _perplexity(AutoModelForCausalLM.from_pretrained(demo / "model"), batches)
    torch.manual_seed(0)
    untrained = _perplexity(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(demo / "model")), batches)
    assert pretrained < 500 < untrained, (pretrained, untrained)
    # 4 QLoRA steps of the config lowered it further on the task's format (measured: 64)
    logged = cli.trainer.callback_metrics["val/perplexity"].item()
    assert logged < pretrained / 2, (logged, pretrained)


def _perplexity(model, batches) -> float:
    """exp of the mean next-token loss over every labelled token (labels -100 carry none), as ``val/perplexity``."""
    nll, tokens = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1]
            labels = batch["labels"][:, 1:]
            keep = labels != -100
            nll += torch.nn.functional.cross_entropy(logits[keep], labels[keep], reduction="sum").item()
            tokens += int(keep.sum())
    return math.exp(nll / tokens)


def test_fine_tuning_teaches_the_task_to_held_out_prompts(demo, tmp_path):
    from pl_lowprec.demo.task_check import check_task

    fast = ["--trainer.plugins=[]", "--trainer.precision=32-true", "--trainer.max_steps=40", "--model.lr=0.01"]
    result = check_task(demo, tmp_path, fast)
    print(result)
    assert result.steps == 40 and result.prompts == 80
    assert result.val_loss_after < result.val_loss_before - 1.0
    assert result.matches_before == 0 and result.matches_after >= 40
