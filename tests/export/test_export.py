"""pl-lowprec export: a checkpoint and its config to a peft adapter directory or a model merged into the original
weights; both load with transformers/peft and compute what the trained module computes."""

import json
import re
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from loading_helpers import save_llama, save_tokenizer

from pl_lowprec.cli import build_cli, main

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

CONFIG = "configs/finetune-causal-lm.yaml"
ALPHA, RANK = 16, 8


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    """A bf16 model directory with a tokenizer and the files a hub repository carries beside them."""
    from transformers import AutoTokenizer

    directory = save_tokenizer(tmp_path_factory.mktemp("pretrained"))
    vocab = len(AutoTokenizer.from_pretrained(directory))
    (directory / "LICENSE").write_text("The model's license, which a merged export carries along.\n")
    (directory / ".gitattributes").write_text("*.safetensors filter=lfs diff=lfs merge=lfs -text\n")
    return save_llama(directory, hidden_size=32, layers=1, vocab_size=vocab, dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "pc.jsonl"
    rows = [{"prompt": f"def f{i}(x):\n    return", "completion": f" x + {i}"} for i in range(40)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def config_args(pretrained, data, root, quantization="nf4", lr=0.05):
    return [
        f"--config={CONFIG}",
        f"--model.pretrained={pretrained}",
        f"--data.tokenizer={pretrained}",
        f"--data.train_files={data}",
        "--data.val_files=null",
        "--data.batch_size=4",
        f"--trainer.strategy.init_args.quantization={quantization}",
        "--trainer.strategy.init_args.activation_checkpointing=null",
        "--trainer.plugins=[]",
        "--trainer.precision=32-true",
        f"--model.lr={lr}",
        "--trainer.val_check_interval=4",
        "--trainer.limit_val_batches=1",
        f"--trainer.default_root_dir={root}",
        "--trainer.enable_progress_bar=false",
        "--trainer.logger=false",
    ]


def fit(pretrained, data, root, quantization="nf4", lr=0.05):
    """Train a few steps and save a checkpoint as the strategy writes it (adapter-only)."""
    args = config_args(pretrained, data, root, quantization, lr)
    cli = build_cli(["fit", *args, "--trainer.max_steps=4"])
    checkpoint = root / "trained.ckpt"
    cli.trainer.save_checkpoint(checkpoint)
    return cli.model, checkpoint, args


@pytest.fixture(scope="module")
def qlora_run(pretrained, data, tmp_path_factory):
    return fit(pretrained, data, tmp_path_factory.mktemp("qlora"))


@pytest.fixture(scope="module")
def lora_run(pretrained, data, tmp_path_factory):
    return fit(pretrained, data, tmp_path_factory.mktemp("lora"), quantization="null", lr=0.005)


def ids():
    return torch.randint(3, 300, (2, 10), generator=torch.Generator().manual_seed(0))


def test_merged_export_of_a_lora_run_computes_what_the_trained_module_computes(pretrained, lora_run, tmp_path):
    """quantization=None: the module computed with the original weights, so the merged model equals it."""
    from transformers import AutoModelForCausalLM

    module, checkpoint, args = lora_run
    out = tmp_path / "merged"
    main(["export", f"--ckpt_path={checkpoint}", f"--out={out}", "--merged", "--dtype=float32", *args])
    merged = AutoModelForCausalLM.from_pretrained(out)
    original = AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.float32)
    moved = merged.model.layers[0].self_attn.q_proj.weight - original.model.layers[0].self_attn.q_proj.weight
    assert moved.abs().max() > 1e-3  # the adapters trained, so the merge changed something
    module.eval()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids()).logits, module(ids()), rtol=0, atol=2e-5)
    assert merged.config.dtype == torch.float32


def test_nf4_merged_export_is_the_original_weights_plus_scale_b_a(pretrained, qlora_run, tmp_path):
    from safetensors.torch import load_file

    _, checkpoint, args = qlora_run
    main(["export", f"--ckpt_path={checkpoint}", f"--out={tmp_path / 'merged'}", "--merged", *args])
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    original = load_file(pretrained / "model.safetensors")
    state = torch.load(checkpoint, weights_only=False)["state_dict"]
    adapted = [k.removeprefix("model.").removesuffix(".lora_A.default.weight") for k in state if "lora_A" in k]
    assert len(adapted) == 7  # q, k, v, o, gate, up, down of the one layer
    for name in adapted:
        a = state[f"model.{name}.lora_A.default.weight"]
        b = state[f"model.{name}.lora_B.default.weight"]
        by_hand = (original[f"{name}.weight"].float() + (b @ a) * (ALPHA / RANK)).to(torch.bfloat16)
        assert merged[f"{name}.weight"].dtype == torch.bfloat16  # the pretrained files' dtype
        assert torch.equal(merged[f"{name}.weight"], by_hand), name
    untouched = set(original) - {f"{n}.weight" for n in adapted}
    assert untouched and all(torch.equal(merged[k], original[k]) for k in untouched)
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert config == json.loads((pretrained / "config.json").read_text())
    assert (tmp_path / "merged" / "tokenizer.json").is_file()
    assert (tmp_path / "merged" / "LICENSE").read_bytes() == (pretrained / "LICENSE").read_bytes()
    (tmp_path / "merged" / "model.safetensors").write_bytes(b"an earlier export")
    main(["export", f"--ckpt_path={checkpoint}", f"--out={tmp_path / 'merged'}", "--merged", "--overwrite", *args])
    assert load_file(tmp_path / "merged" / "model.safetensors").keys() == merged.keys()  # the same export, again


def test_adapter_export_on_the_original_base_equals_the_merged_export(pretrained, qlora_run, tmp_path):
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, checkpoint, args = qlora_run
    main(["export", f"--ckpt_path={checkpoint}", f"--out={tmp_path / 'adapter'}", *args])
    main(["export", f"--ckpt_path={checkpoint}", f"--out={tmp_path / 'merged'}", "--merged", "--dtype=float32", *args])
    base = AutoModelForCausalLM.from_pretrained(pretrained, dtype=torch.float32)
    adapter = PeftModel.from_pretrained(base, tmp_path / "adapter")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        torch.testing.assert_close(adapter(input_ids=ids()).logits, merged(input_ids=ids()).logits, rtol=0, atol=2e-5)
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str(pretrained.resolve())
    assert config["task_type"] == "CAUSAL_LM"  # without it AutoPeftModelForCausalLM "cannot infer the auto class"
    auto = AutoPeftModelForCausalLM.from_pretrained(tmp_path / "adapter", dtype=torch.float32)  # as the docs say
    with torch.no_grad():
        torch.testing.assert_close(auto(input_ids=ids()).logits, merged(input_ids=ids()).logits, rtol=0, atol=2e-5)
    assert len(AutoTokenizer.from_pretrained(tmp_path / "adapter")) == len(AutoTokenizer.from_pretrained(pretrained))


def test_bad_inputs_fail_with_what_to_do(pretrained, data, qlora_run, tmp_path, capsys):
    _, checkpoint, args = qlora_run

    def refused(*command: str) -> str:
        with pytest.raises(SystemExit) as exited:
            main(["export", f"--ckpt_path={checkpoint}", *command])
        assert exited.value.code == 2
        return capsys.readouterr().err

    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    assert "--overwrite would not empty it either" in refused(f"--out={out}", *args)
    assert (out / "keep.txt").is_file()
    assert "is the pretrained weights this command reads" in refused(
        f"--out={pretrained}", "--merged", "--overwrite", *args
    )
    err = refused(f"--out={tmp_path / 'a'}", *args, "--trainer.strategy.init_args.lora.r=4")
    assert re.search(r"does not fit the module built from the config: \d+ tensors have other shapes.*lora= rank", err)
    no_lora = tmp_path / "no_lora.ckpt"
    torch.save({"state_dict": {"model.model.norm.weight": torch.ones(32)}}, no_lora)
    with pytest.raises(SystemExit):
        main(["export", f"--ckpt_path={no_lora}", f"--out={tmp_path / 'b'}", *args])
    assert re.search(r"holds no LoRA weights .*not written by a run with lora=", capsys.readouterr().err)
    assert "The config trains no LoRA adapters" in refused(
        f"--out={tmp_path / 'c'}", *args, "--trainer.strategy.init_args.lora=null"
    )
    assert "no --config given and no config.yaml" in refused(f"--out={tmp_path / 'd'}")  # argparse's usage, exit 2


def test_merged_export_needs_original_weights(tmp_path):
    """A base built from a config (no pretrained=) has no original weights to merge into."""
    from pl_lowprec.export.restore import Restored
    from pl_lowprec.export.write import export
    from pl_lowprec.transforms.lora import inject_lora

    module = torch.nn.Sequential(torch.nn.Linear(4, 4))
    inject_lora(module, {"r": 2})
    restored = Restored(module, None, None, None, tmp_path / "x.ckpt", None)
    with pytest.raises(ValueError, match=r"this config names none .*Export the adapter directory instead"):
        export(restored, tmp_path / "out", merged=True, dtype=None, overwrite=False)
    assert not (tmp_path / "out").exists()


def test_an_adapter_of_a_base_built_from_a_config_says_which_base_it_belongs_to(tmp_path):
    """adapter_config.json can name no base for a model built from a config (the demo's TinyLlama): the export's
    line says so, names the module whose model the adapters load onto, and how."""
    from peft import PeftModel

    from pl_lowprec.export.restore import Restored
    from pl_lowprec.export.write import export
    from pl_lowprec.transforms.lora import inject_lora

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 4))
    base = {k: v.clone() for k, v in module.state_dict().items()}
    inject_lora(module, {"r": 2})
    for name, param in module.named_parameters():
        if "lora_B" in name:
            param.data.normal_()  # trained adapters: not peft's zero start
    restored = Restored(module, None, None, None, tmp_path / "x.ckpt", None)
    line = export(restored, tmp_path / "out", merged=False, dtype=None, overwrite=False)
    assert "Its base was built from the config (torch.nn.modules.container.Sequential" in line
    assert f"PeftModel.from_pretrained(model, {str(tmp_path / 'out')!r})" in line
    assert json.loads((tmp_path / "out" / "adapter_config.json").read_text())["base_model_name_or_path"] is None
    same_base = torch.nn.Sequential(torch.nn.Linear(4, 4))
    same_base.load_state_dict(base)
    loaded = PeftModel.from_pretrained(same_base, tmp_path / "out")
    x = torch.randn(3, 4)
    torch.testing.assert_close(loaded(x), module(x))
    assert not torch.allclose(loaded(x), same_base[0].base_layer(x))  # the adapters count


@pytest.mark.usefixtures("datasets_cache_in_tmp")  # the Parquet prompts' Arrow copy
def test_generate_from_the_checkpoint_the_merged_model_and_the_adapter_agree(pretrained, lora_run, tmp_path):
    _, checkpoint, args = lora_run
    prompts = tmp_path / "prompts.jsonl"
    rows = [
        {"prompt": f"def g{i * '_a'}(x):\n    return", "completion": f" x + {i}"} for i in range(5)
    ]  # lengths differ: padded
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    main(["export", f"--ckpt_path={checkpoint}", f"--out={tmp_path / 'merged'}", "--merged", "--dtype=float32", *args])
    main(["export", f"--ckpt_path={checkpoint}", f"--out={tmp_path / 'adapter'}", *args])
    # the same prompts as a Parquet table in the user's own columns, which the run's data fields name
    from pyarrow import parquet
    from pyarrow import table as arrow_table

    table = tmp_path / "prompts.parquet"
    columns = {"question": [r["prompt"] for r in rows], "answer": [r["completion"] for r in rows]}
    parquet.write_table(arrow_table(columns), table)
    own_columns = [f"--data.train_files={table}", "--data.fields={prompt: question, completion: answer}"]
    outputs = {}
    for name, source in {
        "checkpoint": [f"--ckpt_path={checkpoint}", *args, f"--prompts={prompts}"],
        "merged": [f"--model={tmp_path / 'merged'}", f"--prompts={prompts}"],
        "adapter": [f"--model={tmp_path / 'adapter'}", f"--prompts={prompts}"],
        "one_by_one": [f"--model={tmp_path / 'merged'}", "--batch_size=1", f"--prompts={prompts}"],
        "own_columns": [f"--ckpt_path={checkpoint}", *args, *own_columns, f"--prompts={table}", "--limit=3"],
    }.items():
        out = tmp_path / f"{name}.jsonl"
        main(["generate", *source, f"--out={out}", "--max_new_tokens=6"])
        outputs[name] = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt"] for r in outputs["merged"]] == [r["prompt"] for r in rows]
    assert [r["reference"] for r in outputs["merged"]] == [r["completion"] for r in rows]
    assert outputs["own_columns"] == outputs["checkpoint"][:3]  # read by the run's fields, references too
    completions = {name: [r["completion"] for r in rows_] for name, rows_ in outputs.items()}
    assert completions["checkpoint"] == completions["merged"] == completions["one_by_one"]  # left padding is exact
    # peft's unmerged forward rounds differently (logits equal to 2e-5, tested above), and this random tiny model
    # has near-tied logits, so one greedy choice in a sequence may flip.
    assert sum(a == m for a, m in zip(completions["adapter"], completions["merged"], strict=True)) >= 4
    assert len(set(completions["merged"])) > 1 and all(c.strip() for c in completions["merged"])


def test_restoring_a_config_with_auto_settings_takes_the_fastest_side(qlora_run):
    """The shipped configs' ``"auto"`` settings, restored for export or generate: nothing trains there, so no block
    is checkpointed, no MLP is fused and the loss is not chunked (fit's choice needs a device and a backward)."""
    from pl_lowprec.cli.rebuild import rebuild
    from pl_lowprec.export.restore import restore
    from pl_lowprec.transforms.checkpointing import is_checkpointed
    from pl_lowprec.transforms.fused_lora_mlp import _HOOKED

    _, checkpoint, args = qlora_run
    shipped = [a for a in args if "activation_checkpointing" not in a and "precision" not in a]
    run = rebuild([*shipped, "--trainer.precision=bf16-mixed"])  # the block paths apply to LoRA under bf16
    assert run.trainer.strategy.transform.config.chooses_automatically
    module = restore(checkpoint, run.trainer, run.model, run.datamodule).module
    assert not any(is_checkpointed(m) or getattr(m, _HOOKED, False) for m in module.modules())
    assert module.loss_chunk is None and not module.grouped_cross_entropy


def test_generate_reads_txt_prompts_and_names_bad_records(tmp_path):
    from pl_lowprec.export.generate import Decoding
    from pl_lowprec.export.prompt_files import read_prompts

    txt = tmp_path / "p.txt"
    txt.write_text("first\n\nsecond\n")
    assert read_prompts(txt) == [{"prompt": "first"}, {"prompt": "second"}]
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt"}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2: each record needs a 'prompt' \(a string or a list of turns\)"):
        read_prompts(bad)
    with pytest.raises(ValueError, match=r"p.tsv' is not a file this module reads \('.tsv'\)"):
        read_prompts(tmp_path / "p.tsv") if (tmp_path / "p.tsv").write_text("x") else None
    with pytest.raises(ValueError, match=r"Decoding\(max_new_tokens=0\) must be an integer >= 1"):
        Decoding(max_new_tokens=0)
    assert Decoding().kwargs() == {"max_new_tokens": 64, "do_sample": False}
    with pytest.raises(ValueError, match=r"temperature=0.7, top_k=5 set sampling, and do_sample is off: greedy"):
        Decoding(temperature=0.7, top_k=5)  # transformers would ignore them: greedy completions, said nowhere
    sampled = Decoding(do_sample=True, temperature=0.7).kwargs()
    assert sampled == {"max_new_tokens": 64, "do_sample": True, "temperature": 0.7}  # the rest: generation_config


def test_generate_takes_hub_ids_of_a_model_an_adapter_and_its_base(pretrained, lora_run, tmp_path, monkeypatch, capsys):
    """``generate --model org/name``: a merged model and a peft adapter on the hub (a stand-in download that takes
    only the files asked for, as the real one) complete as their local directories do. The adapter's base, a hub
    id in its adapter_config.json, is downloaded too; the chat template, which transformers saves beside the
    tokenizer as chat_template.jinja, comes with the model. Offline, each refusal names the command that fixes it."""
    from gguf_helpers import refusal_line
    from loading_helpers import stand_in_hub

    _, checkpoint, args = lora_run
    merged, adapter = tmp_path / "merged", tmp_path / "adapter"
    main(["export", f"--ckpt_path={checkpoint}", f"--out={merged}", "--merged", "--dtype=float32", *args])
    main(["export", f"--ckpt_path={checkpoint}", f"--out={adapter}", *args])
    assert (merged / "chat_template.jinja").is_file() and "chat_template" not in (
        merged / "tokenizer_config.json"
    ).read_text()
    prompts = tmp_path / "questions.txt"
    prompts.write_text("def f(x): what does it return?\nimport os\n")
    capsys.readouterr()

    def completions(model: str | Path, name: str) -> list[str]:
        out = tmp_path / f"{name}.jsonl"
        main(["generate", f"--model={model}", f"--prompts={prompts}", "--chat", f"--out={out}", "--max_new_tokens=5"])
        return [json.loads(line)["completion"] for line in out.read_text().splitlines()]

    local = {"merged": completions(merged, "merged"), "adapter": completions(adapter, "adapter")}
    adapter_config = adapter / "adapter_config.json"
    adapter_config.write_text(
        json.dumps({**json.loads(adapter_config.read_text()), "base_model_name_or_path": "org/base"})
    )
    stand_in_hub(monkeypatch, tmp_path / "cache", {"me/merged": merged, "me/adapter": adapter, "org/base": pretrained})
    assert completions("me/merged", "hub_merged") == local["merged"]
    assert completions("me/adapter", "hub_adapter") == local["adapter"]
    assert all(local["merged"])

    base = ["generate", f"--prompts={prompts}", f"--out={tmp_path / 'refused.jsonl'}"]
    line = refusal_line(capsys, [*base, "--model=me/missing"])
    assert "--model 'me/missing' is not a local directory, and downloading it from the Hugging Face Hub failed" in line
    assert "(`hf download me/missing --local-dir DIR`) and pass --model DIR." in line
    adapter_config.write_text(
        json.dumps({**json.loads(adapter_config.read_text()), "base_model_name_or_path": "org/gone"})
    )
    line = refusal_line(capsys, [*base, f"--model={adapter}"])
    assert f"The adapter's base model, {adapter_config}'s base_model_name_or_path: 'org/gone' is not a local" in line
    assert "(`hf download org/gone --local-dir DIR`) and pass --base DIR." in line
    line = refusal_line(capsys, [*base, f"--model={adapter}", "--base=org/gone"])
    assert "--base 'org/gone' is not a local directory" in line and "and pass --base DIR." in line
    (tmp_path / "runs").mkdir()
    monkeypatch.chdir(tmp_path)  # runs/ is here: runs/merged is a local path mistyped, not a hub id
    line = refusal_line(capsys, [*base, "--model=runs/merged"])
    assert "--model 'runs/merged' does not exist: name a directory that `pl-lowprec export` wrote" in line
    assert not (tmp_path / "refused.jsonl").exists()


class StandInHubApi:
    """``huggingface_hub.HfApi`` with no network: ``create_repo`` and ``upload_folder`` record their arguments and
    copy the folder to ``remote/<repo_id>``; ``fail`` makes the upload raise as a lost connection does."""

    calls: ClassVar[list] = []
    remote: Path
    fail = False

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))

    def upload_folder(self, *, repo_id, folder_path, **kwargs):
        import shutil
        from types import SimpleNamespace

        if self.fail:
            raise ConnectionError("no network")
        self.calls.append(("upload_folder", repo_id, Path(folder_path)))
        shutil.copytree(folder_path, self.remote / repo_id, dirs_exist_ok=True)
        return SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/0123abc")


def test_an_export_pushed_to_the_hub_loads_from_its_id(pretrained, data, tmp_path, monkeypatch, capsys):
    """``export --push_to_hub me/adapter --private`` after fine-tuning ``model.pretrained: org/base`` (a hub id,
    downloaded by a stand-in): the adapter records its base as the id (not this machine's cache path), the model
    card names it, and the pushed repository completes as the local directory does. A missing token, a bad id and
    ``--private`` alone are refused before anything is written; a failed upload keeps the export and names
    ``hf upload``."""
    import huggingface_hub
    from gguf_helpers import refusal_line
    from loading_helpers import stand_in_hub

    repos = {"org/base": pretrained}
    stand_in_hub(monkeypatch, tmp_path / "cache", repos)
    StandInHubApi.calls, StandInHubApi.remote = [], tmp_path / "remote"
    monkeypatch.setattr(huggingface_hub, "HfApi", StandInHubApi)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_stand_in")
    _, checkpoint, args = fit("org/base", data, tmp_path / "run", quantization="null", lr=0.005)
    out = tmp_path / "adapter"
    capsys.readouterr()
    main(["export", f"--ckpt_path={checkpoint}", f"--out={out}", *args, "--push_to_hub=me/adapter", "--private"])
    said = capsys.readouterr().out
    assert "Uploaded " + str(out) + " to https://huggingface.co/me/adapter (base_model: org/base)" in said
    assert StandInHubApi.calls == [
        ("create_repo", "me/adapter", {"private": True, "exist_ok": True}),
        ("upload_folder", "me/adapter", out),
    ]
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == "org/base"
    card = (out / "README.md").read_text()
    assert card.startswith("---\n") and "base_model: org/base\n" in card and "library_name: peft\n" in card
    assert "AutoPeftModelForCausalLM.from_pretrained('me/adapter')" in card

    repos["me/adapter"] = tmp_path / "remote" / "me" / "adapter"
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def f(x):\nimport os\n")
    completions = {}
    for name, model in {"local": out, "hub": "me/adapter"}.items():
        main(["generate", f"--model={model}", f"--prompts={prompts}", f"--out={tmp_path / name}.jsonl"])
        completions[name] = (tmp_path / f"{name}.jsonl").read_text()
    assert completions["hub"] == completions["local"]

    merged = tmp_path / "merged"
    main(["export", f"--ckpt_path={checkpoint}", f"--out={merged}", "--merged", *args, "--push_to_hub=me/merged"])
    assert StandInHubApi.calls[-2] == ("create_repo", "me/merged", {"private": None, "exist_ok": True})
    card = (merged / "README.md").read_text()
    assert "base_model: org/base\n" in card and "library_name: transformers\n" in card

    base = ["export", f"--ckpt_path={checkpoint}", f"--out={tmp_path / 'refused'}", *args]
    line = refusal_line(capsys, [*base, "--push_to_hub=me/adapter/v2"])
    assert "--push_to_hub 'me/adapter/v2' is not a model repository id: name it as 'user/name'" in line
    line = refusal_line(capsys, [*base, "--private"])
    assert "--private makes the --push_to_hub repository private: pass --push_to_hub USER/NAME too." in line
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)
    line = refusal_line(capsys, [*base, "--push_to_hub=me/adapter"])
    assert "needs a Hugging Face token with write access, and none is set here: run `hf auth login`" in line
    assert not (tmp_path / "refused").exists()
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: "hf_stand_in")
    StandInHubApi.fail = True
    line = refusal_line(capsys, [*base, "--push_to_hub=me/adapter"])
    assert f"The export in '{tmp_path / 'refused'}' is complete, but uploading it to 'me/adapter' failed" in line
    assert "(ConnectionError: no network). Upload the directory once that is fixed: `hf upload me/adapter" in line
    assert (tmp_path / "refused" / "adapter_model.safetensors").is_file()
