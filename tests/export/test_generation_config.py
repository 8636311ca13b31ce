"""The pretrained directory's ``generation_config.json`` reaches the model ``CausalLM`` builds: it was derived from
``config.json`` (``from_config``), so ``generate --ckpt_path`` ignored the file's EOS ids and defaults
(``repetition_penalty``) that ``generate --model`` of the merged export, and transformers' ``from_pretrained``,
apply: the checkpoint's completions differed from the export's."""

import json

import pytest
import torch
from loading_helpers import save_llama, save_tokenizer
from own_module_helpers import OWN_CAUSAL_LM, write_own_config, write_own_module

from pl_lowprec.cli import build_cli, main

pytest.importorskip("transformers")
pytest.importorskip("peft")

PENALTY = 1.8  # large, so greedy completions of a random tiny model change under it


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A 2-step LoRA run (no quantization, fp32) on a model whose directory has a generation_config.json."""
    from transformers import AutoTokenizer, GenerationConfig

    directory = save_tokenizer(tmp_path_factory.mktemp("pretrained"))
    tokenizer = AutoTokenizer.from_pretrained(directory)
    save_llama(directory, hidden_size=32, layers=1, vocab_size=len(tokenizer))
    user = tokenizer.convert_tokens_to_ids("<|user|>")
    GenerationConfig(eos_token_id=[tokenizer.eos_token_id, user], repetition_penalty=PENALTY).save_pretrained(directory)
    root = tmp_path_factory.mktemp("run")
    data = root / "pc.jsonl"
    rows = [{"prompt": f"def f{i}(x):\n    return", "completion": f" x + {i}"} for i in range(16)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [
        "--config=configs/finetune-causal-lm.yaml",
        f"--model.pretrained={directory}",
        f"--data.tokenizer={directory}",
        f"--data.train_files={data}",
        "--data.val_files=null",
        "--data.batch_size=4",
        "--trainer.strategy.init_args.quantization=null",
        "--trainer.strategy.init_args.activation_checkpointing=null",
        "--trainer.plugins=[]",
        "--trainer.precision=32-true",
        "--model.lr=0.01",
        "--trainer.limit_val_batches=0",
        "--trainer.enable_progress_bar=false",
        "--trainer.logger=false",
        f"--trainer.default_root_dir={root}",
    ]
    cli = build_cli(["fit", *args, "--trainer.max_steps=2", "--trainer.callbacks=[]"])
    checkpoint = root / "trained.ckpt"
    cli.trainer.save_checkpoint(checkpoint)
    return cli.model, checkpoint, args, root


def test_causal_lm_builds_its_model_with_the_directorys_generation_config(run):
    model = run[0].model
    assert model.generation_config.repetition_penalty == PENALTY
    assert len(model.generation_config.eos_token_id) == 2


def test_generate_from_the_checkpoint_completes_as_the_merged_export_and_transformers_do(run, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, checkpoint, args, _ = run
    prompts = tmp_path / "prompts.txt"
    lines = ["def f(x):", "import os", "class Parser(object):", "    return self._"]
    prompts.write_text("\n".join(lines) + "\n")
    merged = tmp_path / "merged"
    main(["export", f"--ckpt_path={checkpoint}", f"--out={merged}", "--merged", "--dtype=float32", *args])
    outputs = {}
    for name, source in {"checkpoint": [f"--ckpt_path={checkpoint}", *args], "merged": [f"--model={merged}"]}.items():
        out = tmp_path / f"{name}.jsonl"
        main(["generate", *source, f"--prompts={prompts}", f"--out={out}", "--max_new_tokens=12", "--batch_size=1"])
        outputs[name] = [json.loads(line)["completion"] for line in out.read_text().splitlines()]
    model = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(merged)
    expected = []
    for line in lines:
        ids = tokenizer(line, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**ids, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        expected.append(tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True))
    assert outputs["merged"] == expected
    assert outputs["checkpoint"] == expected


def test_generate_from_a_checkpoint_of_the_users_own_module_takes_the_strategys_generation_config(
    tmp_path, monkeypatch
):
    """A module of the user's that builds its model with ``from_config`` and lets the strategy fill it."""
    from transformers import GenerationConfig

    from pl_lowprec.cli.rebuild import rebuild
    from pl_lowprec.export.generate import from_restored
    from pl_lowprec.export.restore import restore

    pretrained = save_tokenizer(tmp_path / "pretrained")
    save_llama(pretrained)
    GenerationConfig(eos_token_id=[1, 4], repetition_penalty=PENALTY).save_pretrained(pretrained)
    write_own_module(tmp_path, "own_lm", OWN_CAUSAL_LM, monkeypatch)
    write_own_config(tmp_path / "own.yaml", "own_lm.MyLM", "own_lm.Bytes", pretrained, {"lora": {"r": 4}})
    main(["fit", "--config", "own.yaml"])
    (checkpoint,) = tmp_path.glob("runs/lightning_logs/version_0/checkpoints/*.ckpt")
    rebuilt = rebuild(["--config", "own.yaml"])
    restored = restore(checkpoint, rebuilt.trainer, rebuilt.model, rebuilt.datamodule)
    generator = from_restored(restored, tokenizer=str(pretrained))
    assert generator.model.generation_config.repetition_penalty == PENALTY
    assert generator.model.generation_config.eos_token_id == [1, 4]


def test_sampling_takes_the_models_generation_config_as_transformers_generate_does(tmp_path, capsys):
    """``--do_sample`` without ``--temperature``/``--top_p``/``--top_k`` samples as ``model.generate(do_sample=True)``
    does, with the model's settings (they were 1.0, 1.0 and 50 whatever generation_config.json said); the output
    says which it used. Three prompts of different lengths: one left-padded batch, as generate pads it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    directory = save_tokenizer(tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    save_llama(directory, hidden_size=32, layers=1, vocab_size=len(tokenizer))
    eos = tokenizer.eos_token_id  # as a hub model's file names it (generate stops at the tokenizer's EOS too)
    GenerationConfig(do_sample=True, temperature=0.3, top_p=0.6, top_k=7, eos_token_id=eos).save_pretrained(directory)
    lines = ["def f(x):", "import os", "class Parser(object):"]
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(lines) + "\n")
    out = tmp_path / "sampled.jsonl"
    main(["generate", f"--model={directory}", f"--prompts={prompts}", f"--out={out}", "--do_sample", "--seed=3"])
    said = capsys.readouterr().out
    assert "Sampling with temperature 0.3 (the model's generation_config), top_p 0.6" in said
    completions = [json.loads(line)["completion"] for line in out.read_text().splitlines()]

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ids = [tokenizer(line)["input_ids"] for line in lines]
    width, pad = max(map(len, ids)), tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(i)) + i for i in ids])
    mask = torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids])
    torch.manual_seed(3)
    with torch.no_grad():
        out_ids = model.generate(input_ids=input_ids, attention_mask=mask, pad_token_id=pad, max_new_tokens=64)
    assert completions == tokenizer.batch_decode(out_ids[:, width:], skip_special_tokens=True)


def test_an_adapter_on_a_base_of_other_shapes_is_refused_in_one_line(tmp_path, capsys):
    """``--base`` naming another model: peft's size-mismatch RuntimeError was a traceback of every LoRA tensor."""
    from gguf_helpers import refusal_line
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    trained_on = save_llama(tmp_path / "small", hidden_size=32, layers=1)
    other = save_llama(tmp_path / "other", hidden_size=64, layers=1)
    adapter = tmp_path / "adapter"
    base = AutoModelForCausalLM.from_pretrained(trained_on)
    get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(adapter)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(x):\n")
    args = ["generate", f"--model={adapter}", f"--base={other}", f"--tokenizer={save_tokenizer(tmp_path / 'tok')}"]
    line = refusal_line(capsys, [*args, f"--prompts={prompts}", f"--out={tmp_path / 'out.jsonl'}"])
    assert f"The adapter '{adapter}' does not fit the base model '{other}'" in line
    assert "Pass --base with the model it was trained on" in line


def test_an_unreadable_generation_config_warns_and_leaves_the_derived_one(tmp_path):
    """The file only matters to generate: a broken one must not stop a fit."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pl_lowprec.loading.generation_config import load_generation_config

    directory = save_llama(tmp_path / "model", hidden_size=32, layers=1)
    (directory / "generation_config.json").write_text("{not json")
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory))
    with pytest.warns(UserWarning, match="generation_config.json is not read"):
        assert load_generation_config(model, directory) is False
    assert model.generation_config.eos_token_id == model.config.eos_token_id


def test_one_function_reads_the_models_generation_defaults_for_stops_and_sampling(tmp_path):
    """``generate``'s stop ids and its sampling line read the model's ``generation_config`` through
    ``generation_default`` (each read it on its own before): the file's EOS list and temperature reach both."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from pl_lowprec.export.generate import Decoding
    from pl_lowprec.export.stop_tokens import stop_token_ids
    from pl_lowprec.loading.generation_config import generation_default, load_generation_config

    directory = save_tokenizer(tmp_path / "model")
    tokenizer = AutoTokenizer.from_pretrained(directory)
    save_llama(directory, hidden_size=32, layers=1, vocab_size=len(tokenizer))
    user = tokenizer.convert_tokens_to_ids("<|user|>")
    GenerationConfig(eos_token_id=[user, tokenizer.eos_token_id], do_sample=True, temperature=0.6).save_pretrained(
        directory
    )
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory))
    assert generation_default(model, "temperature") in (None, 1.0)  # derived from config.json
    assert load_generation_config(model, directory)
    assert generation_default(model, "eos_token_id") == [user, tokenizer.eos_token_id]
    assert generation_default(object(), "eos_token_id") is None  # no generation_config at all
    assert stop_token_ids(model, tokenizer)[:2] == [user, tokenizer.eos_token_id]
    line = Decoding(do_sample=True).sampling_line(model)
    assert line.startswith("Sampling with temperature 0.6 (the model's generation_config), top_p 1.0")
