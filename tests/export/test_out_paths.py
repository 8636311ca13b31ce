"""export and generate never write over what they read, and over nothing else unless asked (--overwrite)."""

import json
import re

import pytest
import torch

from pl_lowprec.cli import main
from pl_lowprec.export.out_paths import check_out_dir, prepare_out_dir, prepare_out_file


@pytest.fixture
def run(tmp_path):
    """A run directory as LightningCLI leaves it: config.yaml beside checkpoints/last.ckpt."""
    run = tmp_path / "runs/lightning_logs/version_0"
    (run / "checkpoints").mkdir(parents=True)
    torch.save({"state_dict": {"w": torch.ones(3)}}, run / "checkpoints/last.ckpt")
    (run / "config.yaml").write_text("model:\n  class_path: x\n")
    return run


def snapshot(directory):
    return {p: p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def refused(capsys, args) -> str:
    """The command stops with exit status 2 and one line on stderr (``pl-lowprec <command>: error: ...``)."""
    with pytest.raises(SystemExit) as exited:
        main(args)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    ("out", "relation"),
    [("checkpoints", "holds the checkpoint"), (".", "holds the checkpoint"), ("config.yaml", "is the config")],
)
def test_export_never_writes_over_the_checkpoint_or_config_it_reads(run, out, relation, capsys):
    before = snapshot(run.parents[2])
    args = ["export", f"--ckpt_path={run / 'checkpoints/last.ckpt'}", f"--out={run / out}", "--overwrite"]
    assert re.search(rf"--out .* {relation} this command reads .*not even --overwrite", refused(capsys, args))
    assert snapshot(run.parents[2]) == before


def test_overwrite_replaces_a_previous_export_and_nothing_else(tmp_path):
    previous = tmp_path / "previous"
    previous.mkdir()
    for name in ("adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "README.md"):
        (previous / name).write_text("old")
    with pytest.raises(ValueError, match=r"exists and is not empty: pass --overwrite"):
        prepare_out_dir(previous, overwrite=False, inputs={})
    assert len(list(previous.iterdir())) == 4
    prepare_out_dir(previous, overwrite=True, inputs={})
    assert list(previous.iterdir()) == []

    data = tmp_path / "data"  # a directory of training files is no export, --overwrite or not
    data.mkdir()
    (data / "train.jsonl").write_text('{"text": "keep me"}\n')
    (data / "config.json").write_text("{}")
    before = snapshot(data)
    with pytest.raises(ValueError, match=r"holds train.jsonl, which no export writes.*will not empty it"):
        prepare_out_dir(data, overwrite=True, inputs={})
    assert snapshot(data) == before
    pretrained = tmp_path / "pretrained"
    pretrained.mkdir()
    (pretrained / "model.safetensors").write_text("weights")
    with pytest.raises(ValueError, match=r"is the pretrained weights this command reads"):
        prepare_out_dir(pretrained, overwrite=True, inputs={"pretrained weights": pretrained})
    with pytest.raises(ValueError, match=r"lies inside the pretrained weights"):
        prepare_out_file(pretrained / "model.safetensors", overwrite=True, inputs={"pretrained weights": pretrained})
    assert (pretrained / "model.safetensors").read_text() == "weights"


def test_overwrite_replaces_the_pretrained_files_a_merged_export_copied_and_only_those(tmp_path):
    """A merged export copies the pretrained directory's other files (LICENSE, .gitattributes): byte for byte
    the same, they are written again, so --overwrite replaces them; changed, they are someone's and stop it."""
    pretrained = tmp_path / "pretrained"
    pretrained.mkdir()
    for name, text in (("model.safetensors", "weights"), ("LICENSE", "license"), (".gitattributes", "lfs")):
        (pretrained / name).write_text(text)
    inputs = {"pretrained weights": pretrained}
    previous = tmp_path / "merged"
    previous.mkdir()
    for name, text in (("model.safetensors", "merged"), ("config.json", "{}"), ("LICENSE", "license")):
        (previous / name).write_text(text)
    (previous / ".gitattributes").write_text("lfs, edited")
    before = snapshot(previous)
    with pytest.raises(ValueError, match=r"holds .gitattributes, which no export writes"):
        prepare_out_dir(previous, overwrite=True, inputs=inputs)
    assert snapshot(previous) == before
    for overwrite in (True, False):  # judged once the pretrained directory is known
        check_out_dir(previous, overwrite=overwrite, inputs={}, pretrained_known=False)
    data = tmp_path / "data"  # no export's file at all: no export's copies either, said at once
    data.mkdir()
    (data / "LICENSE").write_text("license")
    with pytest.raises(ValueError, match=r"holds LICENSE, which no export writes"):
        check_out_dir(data, overwrite=True, inputs={}, pretrained_known=False)
    (previous / ".gitattributes").write_text("lfs")
    prepare_out_dir(previous, overwrite=True, inputs=inputs)
    assert list(previous.iterdir()) == []


def test_overwrite_replaces_a_previous_gguf_export_even_one_killed_mid_merge(tmp_path):
    """A GGUF export writes model-<type>.gguf and Modelfile; one killed before it finished leaves its temporary
    merged directory (.merged-*, export files only). --overwrite replaces those, and only those."""
    previous = tmp_path / "gguf"
    (previous / ".merged-k2x9").mkdir(parents=True)
    for name in ("model-q8_0.gguf", "Modelfile", ".merged-k2x9/model.safetensors", ".merged-k2x9/config.json"):
        (previous / name).write_text("old")
    prepare_out_dir(previous, overwrite=True, inputs={})
    assert list(previous.iterdir()) == []

    for kept in (".merged-k2x9/notes.txt", "model-q3_k.gguf", "weights/model.safetensors"):
        out = tmp_path / kept.replace("/", "_")
        (out / kept).parent.mkdir(parents=True)
        (out / kept).write_text("keep me")
        (out / "Modelfile").write_text("FROM ./model.gguf")
        before = snapshot(out)
        with pytest.raises(ValueError, match=rf"holds {kept.split('/')[0]}, which no export writes"):
            prepare_out_dir(out, overwrite=True, inputs={})
        assert snapshot(out) == before


def test_export_says_the_checkpoint_is_missing_or_not_a_checkpoint(run, tmp_path, capsys):
    missing = run / "checkpoints/missing.ckpt"
    err = refused(capsys, ["export", f"--ckpt_path={missing}", f"--out={tmp_path / 'out'}"])
    assert re.search(r"--ckpt_path '.*missing.ckpt' does not exist", err)
    text = run / "checkpoints/notes.ckpt"
    text.write_text("not a checkpoint\n")
    err = refused(capsys, ["export", f"--ckpt_path={text}", f"--out={tmp_path / 'out'}"])
    assert re.search(r"'.*notes.ckpt' is not a Lightning checkpoint \(not a torch.save archive", err)
    assert not (tmp_path / "out").exists()


def test_generate_refuses_an_existing_out_and_never_overwrites_its_prompts(tmp_path, capsys):
    prompts = tmp_path / "train.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"p{i}", "completion": f"c{i}"}) + "\n" for i in range(400)))
    existing = tmp_path / "completions.jsonl"
    existing.write_text('{"prompt": "p", "completion": "kept"}\n')
    (tmp_path / "merged").mkdir()
    before = snapshot(tmp_path)  # never loaded: --out is refused first
    model = ["generate", f"--model={tmp_path / 'merged'}", f"--prompts={prompts}"]
    err = refused(capsys, [*model, f"--out={existing}"])
    assert re.search(r"--out '.*completions.jsonl' exists: pass --overwrite to replace it", err)
    err = refused(capsys, [*model, f"--out={prompts}", "--overwrite"])
    assert re.search(r"--out '.*train.jsonl' is the prompts file this command reads", err)
    assert snapshot(tmp_path) == before
    prepare_out_file(existing, overwrite=True, inputs={"prompts file": prompts})  # asked: allowed
