"""``pl-lowprec export --ckpt_path`` of a checkpoint holding every weight (``adapter_only_checkpoint=False``): its
restore streamed all of ``pretrained=`` (opened once for the headers and once per module) and loaded the checkpoint
over it; a merge now reads only the headers first (the prefix it writes the original keys with), an adapter export
nothing. The merge still reads the original files (the full-precision weights under a QLoRA base), and writes the
same bytes as before."""

from __future__ import annotations

import hashlib
import importlib
from contextlib import contextmanager

import pytest
from gguf_helpers import fit_args, fitted_checkpoint
from loading_helpers import count_safetensors_opens, save_pretrained_dir, write_prompt_completion

from pl_lowprec.cli import main

pytest.importorskip("transformers")
pytest.importorskip("peft")


@contextmanager
def _streamed_as_before(monkeypatch):
    """The restore as it was: ``pretrained=`` streamed in, then the checkpoint loaded over it."""
    with monkeypatch.context() as patch:
        patch.setattr(importlib.import_module("pl_lowprec.transforms.pipeline"), "fills_every_weight", lambda *_: False)
        yield


def _digests(directory) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(directory.iterdir())}


def _trained_whole(tmp_path, *extra_args):
    """A pretrained base, the run's arguments, and a checkpoint of that run holding every weight (LoRA too)."""
    base = save_pretrained_dir(tmp_path / "base")
    args = [
        *fit_args(base, write_prompt_completion(tmp_path / "pc.jsonl"), tmp_path / "run"),
        *extra_args,
        "--trainer.strategy.init_args.adapter_only_checkpoint=false",
    ]
    return base, args, fitted_checkpoint(args, tmp_path / "trained.ckpt")


@pytest.mark.parametrize("quantization", ["null", "nf4"])
def test_merged_export_of_a_whole_checkpoint_streams_no_base(tmp_path, monkeypatch, quantization):
    if quantization != "null":
        pytest.importorskip("bitsandbytes")
    base, args, checkpoint = _trained_whole(tmp_path, f"--trainer.strategy.init_args.quantization={quantization}")
    export = ["export", f"--ckpt_path={checkpoint}", "--merged"]
    with _streamed_as_before(monkeypatch):
        main([*export, f"--out={tmp_path / 'streamed'}", *args])
    opened = count_safetensors_opens(monkeypatch, base)
    main([*export, f"--out={tmp_path / 'merged'}", *args])
    # the restore's headers, then the merge's headers and tensors: 15 before (1 + 12 modules' streams, then 2)
    assert opened == ["model.safetensors"] * 3
    assert _digests(tmp_path / "merged") == _digests(tmp_path / "streamed")


def test_adapter_export_of_a_whole_checkpoint_reads_nothing_of_the_base(tmp_path, monkeypatch):
    base, args, checkpoint = _trained_whole(tmp_path)
    with _streamed_as_before(monkeypatch):
        main(["export", f"--ckpt_path={checkpoint}", f"--out={tmp_path / 'streamed'}", *args])
    opened = count_safetensors_opens(monkeypatch, base)
    main(["export", f"--ckpt_path={checkpoint}", f"--out={tmp_path / 'adapter'}", *args])
    assert opened == []  # 13 with the streamed restore (1 + 12 modules), 1 with the headers read for a merge
    assert _digests(tmp_path / "adapter") == _digests(tmp_path / "streamed")


def test_generate_from_a_whole_checkpoint_reads_nothing_of_the_base(tmp_path, monkeypatch):
    """``generate --ckpt_path`` restores as an adapter export does: it merges into no original file, so it reads
    not even the headers for their key prefix (it read them, a ``.bin`` base unpickled whole, for nothing)."""
    base, args, checkpoint = _trained_whole(tmp_path)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\nimport os\n", encoding="utf-8")
    generate = ["generate", f"--ckpt_path={checkpoint}", f"--prompts={prompts}", "--max_new_tokens=4"]
    with _streamed_as_before(monkeypatch):
        main([*generate, f"--out={tmp_path / 'streamed.jsonl'}", *args])
    opened = count_safetensors_opens(monkeypatch, base)
    main([*generate, f"--out={tmp_path / 'restored.jsonl'}", *args])
    assert opened == []  # 13 with the streamed restore, 1 with the headers read for a merge
    assert (tmp_path / "restored.jsonl").read_text() == (tmp_path / "streamed.jsonl").read_text()
