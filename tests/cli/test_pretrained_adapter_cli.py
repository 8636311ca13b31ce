"""``pretrained_adapter=`` through ``pl-lowprec estimate`` and ``pl-lowprec plan``: the trainable count is peft's for
the adapter's config, and plan, which rebuilds the strategy's config for every candidate, resolves a hub adapter
once (it resolved it once a candidate: a hub round trip each)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from loading_helpers import save_pretrained_dir, stand_in_hub, write_prompt_completion

from pl_lowprec.cli import main

peft = pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

FINETUNE = str(Path(__file__).resolve().parents[2] / "configs/finetune-causal-lm.yaml")
SAVED = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"], "modules_to_save": ["lm_head"]}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """A 2-layer Llama with its tokenizer, a peft adapter saved for it, and prompt/completion records."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("adapter_cli")
    base = save_pretrained_dir(root / "base", hidden_size=64, layers=2)
    adapter = root / "adapter"
    peft.get_peft_model(AutoModelForCausalLM.from_pretrained(base), peft.LoraConfig(**SAVED)).save_pretrained(adapter)
    reference = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter, is_trainable=True)
    trainable = sum(p.numel() for p in reference.parameters() if p.requires_grad)
    return base, adapter, write_prompt_completion(root / "pc.jsonl"), trainable


def _args(base: Path, data: Path, adapter: str) -> list[str]:
    return [
        f"--config={FINETUNE}",
        f"--model.pretrained={base}",
        f"--data.tokenizer={base}",
        f"--data.train_files={data}",
        "--data.val_files=null",
        "--trainer.val_check_interval=1.0",
        f"--trainer.strategy.init_args.pretrained_adapter={adapter}",
        "--trainer.strategy.init_args.lora=null",  # the config's own LoRA options would differ from the adapter's
    ]


def _trainable(capsys, *args: str) -> int:
    main(["estimate", *args])
    return int(re.search(r"\(([\d,]+) parameters, ([\d,]+) trainable\)", capsys.readouterr().out)[2].replace(",", ""))


def test_estimate_counts_the_adapters_trainable_parameters_as_peft_does(files, capsys):
    base, adapter, data, in_peft = files
    assert _trainable(capsys, *_args(base, data, str(adapter))) == in_peft


def test_plan_resolves_a_hub_adapter_once_and_writes_a_config_that_trains_it(files, tmp_path, monkeypatch, capsys):
    import huggingface_hub

    base, adapter, data, in_peft = files
    stand_in_hub(monkeypatch, tmp_path / "cache", {"org/adapter": adapter})
    download, downloads = huggingface_hub.snapshot_download, []
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: downloads.append(a) or download(*a, **k))
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "plan.yaml"
    main(["plan", *_args(base, data, "org/adapter"), "--memory=64MiB", f"--out={out}"])
    printed = capsys.readouterr().out
    assert len(re.findall(r"^[* ] yes ", printed, re.MULTILINE)) > 1  # several candidates were estimated
    assert len(downloads) == 1
    strategy = yaml.safe_load(out.read_text())["trainer"]["strategy"]["init_args"]
    assert strategy["pretrained_adapter"] == "org/adapter"
    assert _trainable(capsys, f"--config={out}") == in_peft
