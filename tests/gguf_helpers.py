"""Shared by the GGUF export tests: shrunk real-config models, conversion, read-back, and the user's fit path."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import torch


def refusal_line(capsys, args: list[str]) -> str:
    """``pl-lowprec`` refuses ``args`` as every subcommand does: exit status 2 and one ``error:`` line (the
    paragraph), no traceback; that line."""
    import pytest

    from pl_lowprec.cli import main

    with pytest.raises(SystemExit) as exited:
        main(args)
    text = "".join(capsys.readouterr())  # stdout too: nothing of a traceback anywhere
    assert exited.value.code == 2, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    errors = [line for line in text.splitlines() if "error: " in line]
    assert len(errors) == 1, text[-3000:]
    return errors[0]


def fail_if_called(monkeypatch, targets: list[str], what: str) -> None:
    """Each of ``targets`` (dotted names, as ``monkeypatch.setattr`` takes them) fails the test if called: a refusal
    must come before ``what`` (the slow step it guards)."""

    def called(*args, **kwargs):
        raise AssertionError(f"{what} before the refusal")

    for target in targets:
        monkeypatch.setattr(target, called)


def shrunk_model(
    directory: Path, tokenizer_dir: Path, shape: dict, head_dim: int, rows: int, layers: int = 2, **overrides
) -> Path:
    """A bf16 model directory with a real config's quirks (heads, tying, biases, rope), ``layers`` layers and heads
    of ``head_dim``, ``rows`` embedding rows, random weights, and the tokenizer of ``tokenizer_dir``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(shape, num_hidden_layers=layers, vocab_size=rows, **overrides)
    hidden = fields["num_attention_heads"] * head_dim
    fields.update(hidden_size=hidden, intermediate_size=2 * hidden)
    if "head_dim" in fields:
        fields["head_dim"] = head_dim
    if "max_window_layers" in fields:
        fields["max_window_layers"] = layers
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(fields))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory)).to(torch.bfloat16).save_pretrained(
        directory
    )
    for path in tokenizer_dir.iterdir():
        shutil.copy(path, directory / path.name)
    return directory


def gguf_dir(model_dir: Path) -> Path:
    """Where ``convert`` writes: a directory of its own, as the export's (no tokenizer files beside the GGUF)."""
    return model_dir.with_name(f"{model_dir.name}-gguf")


def convert(model_dir: Path, gguf_type: str, name: str = "tiny-model") -> dict:
    from pl_lowprec.export.gguf_convert import convert_to_gguf

    gguf_dir(model_dir).mkdir(exist_ok=True)
    return convert_to_gguf(model_dir, gguf_dir(model_dir) / f"model-{gguf_type}.gguf", gguf_type, name)


def logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def held_out_ids(vocab: int = 320, low: int = 6) -> torch.Tensor:
    return torch.randint(low, vocab, (3, 24), generator=torch.Generator().manual_seed(1))


def metadata(path: Path) -> tuple[dict, dict]:
    import gguf

    reader = gguf.GGUFReader(path)
    fields = {name: field.contents() for name, field in reader.fields.items()}
    return fields, {t.name: t for t in reader.tensors}


def fit_args(pretrained: Path, data: Path, root: Path) -> list[str]:
    """``pl-lowprec fit`` of the shipped QLoRA config on ``pretrained`` (its own tokenizer): a few fp32 steps."""
    return [
        "--config=configs/finetune-causal-lm.yaml",
        f"--model.pretrained={pretrained}",
        f"--data.tokenizer={pretrained}",
        f"--data.train_files={data}",
        "--data.val_files=null",
        "--data.batch_size=4",
        "--trainer.strategy.init_args.activation_checkpointing=null",
        "--trainer.plugins=[]",
        "--trainer.precision=32-true",
        "--model.lr=0.005",
        "--trainer.limit_val_batches=0",
        f"--trainer.default_root_dir={root}",
        "--trainer.enable_progress_bar=false",
        "--trainer.logger=false",
    ]


def fitted_checkpoint(args: list[str], checkpoint: Path, steps: int = 2) -> Path:
    """``pl-lowprec fit`` of ``args`` for ``steps`` steps, in this process, saved to ``checkpoint``."""
    from pl_lowprec.cli import build_cli

    build_cli(["fit", *args, f"--trainer.max_steps={steps}"]).trainer.save_checkpoint(checkpoint)
    return checkpoint


def fit_and_export(pretrained: Path, root: Path, rows: list[dict]) -> tuple[Path, list[str], str]:
    """Fit 4 steps on ``rows`` (jsonl records), then export the checkpoint ``--merged`` and ``--format gguf`` (bf16)
    into ``root/merged`` and ``root/gguf``; the checkpoint, the fit arguments and what the GGUF export printed."""
    from pl_lowprec.cli import main

    data = root / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = fit_args(pretrained, data, root)
    checkpoint = fitted_checkpoint(args, root / "trained.ckpt", steps=4)
    main(["export", f"--ckpt_path={checkpoint}", f"--out={root / 'merged'}", "--merged", *args])
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        main(["export", f"--ckpt_path={checkpoint}", f"--out={root / 'gguf'}", "--format=gguf", *args])
    return checkpoint, args, printed.getvalue()


def load_exported(exported: Path) -> tuple:
    """The ``--merged`` export and the GGUF read back by transformers (both computing in float32), each with its
    tokenizer: the merged directory's, and the one transformers rebuilds from the GGUF's metadata."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    merged = AutoModelForCausalLM.from_pretrained(exported / "merged", dtype=torch.float32)
    read = AutoModelForCausalLM.from_pretrained(exported / "gguf", gguf_file="model-bf16.gguf", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(exported / "merged")
    from_gguf = AutoTokenizer.from_pretrained(exported / "gguf", gguf_file="model-bf16.gguf")
    return merged, tokenizer, read, from_gguf


def assert_completes_as_merged(exported: Path, prompts: list[str], ids: torch.Tensor) -> None:
    """``exported`` holds the GGUF and its Modelfile only; the GGUF read back gives the merged export's logits on
    ``ids`` (the same bf16 bits), its tokenizer encodes ``prompts`` alike, and greedy completions (each model with
    its own tokenizer) agree on at least 95% of them, in fact on all."""
    from pl_lowprec.export.generate import Decoding, Generator

    assert sorted(p.name for p in (exported / "gguf").iterdir()) == ["Modelfile", "model-bf16.gguf"]
    merged, tokenizer, read, from_gguf = load_exported(exported)
    torch.testing.assert_close(logits(read, ids), logits(merged, ids), rtol=0, atol=1e-6)
    assert [from_gguf(p)["input_ids"] for p in prompts] == [tokenizer(p)["input_ids"] for p in prompts]
    decoding = Decoding(max_new_tokens=8)
    expected = Generator(merged, tokenizer).complete(prompts, decoding)
    got = Generator(read, from_gguf).complete(prompts, decoding)
    assert len(set(expected)) > 1  # the completions differ between prompts: the comparison can fail
    assert sum(a == b for a, b in zip(got, expected, strict=True)) >= 0.95 * len(prompts)
    assert got == expected
