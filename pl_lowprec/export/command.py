"""``pl-lowprec export``: a training checkpoint and its config to a peft adapter directory or a merged model.

    pl-lowprec export --config configs/finetune-causal-lm.yaml --ckpt_path runs/.../last.ckpt --out runs/adapter
    pl-lowprec export --config ... --ckpt_path ... --out runs/merged --merged [--dtype float32]

Arguments the export does not know (``--model.pretrained DIR``, ``--trainer.accelerator cpu``) go to the config,
as for ``pl-lowprec fit``. Without ``--config``, the ``config.yaml`` LightningCLI saved next to the run's
``checkpoints/`` directory is used.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pl_lowprec.adapters import export_adapter
from pl_lowprec.cli.resume import check_checkpoint
from pl_lowprec.export.merged import merge_into_pretrained
from pl_lowprec.export.out_paths import prepare_out_dir, refuse_inputs
from pl_lowprec.export.restore import ConfigClassError, Restored, default_config, restore


def pretrained_dir(restored: Restored) -> Path | None:
    """The model directory the pretrained weights came from (config, tokenizer), if they came from one."""
    if restored.weights is None:
        return None
    path = Path(restored.weights.path)
    return path if path.is_dir() else None


def save_tokenizer(restored: Restored, out: Path) -> str | None:
    """The training data's tokenizer (else the pretrained directory's), saved into ``out``; where it came from."""
    from pl_lowprec.data.text import load_tokenizer

    source = pretrained_dir(restored)
    for candidate in (restored.tokenizer_dir, source):
        if candidate is None:
            continue
        try:
            load_tokenizer(candidate).save_pretrained(str(out))
        except ValueError:
            continue
        return str(candidate)
    return None


def export(
    restored: Restored, out: Path, merged: bool, dtype: str | None, overwrite: bool, inputs: dict | None = None
) -> str:
    """Write the export and return a one-line summary; ``inputs`` (``{what: path}``) are never written over."""
    source = pretrained_dir(restored)
    if merged:
        if restored.weights is None:
            raise ValueError(
                "A merged export adds the adapters to the original pretrained weights, and this config names none"
                " (CausalLM(pretrained=...) or the strategy's pretrained=): its base was built from a config with"
                " random or seeded weights. Export the adapter directory instead (leave out --merged)."
            )
        if source is None and restored.hf_model is None:
            raise ValueError(
                f"pretrained={str(restored.weights.path)!r} is a single file and the module holds no Hugging Face"
                " model whose config could go with the merged weights. Point pretrained= at a model directory."
            )
    read = {
        **(inputs or {}),
        "checkpoint": restored.checkpoint,
        "pretrained weights": Path(restored.weights.path) if restored.weights is not None else None,
        "tokenizer directory": Path(restored.tokenizer_dir) if restored.tokenizer_dir else None,
    }
    prepare_out_dir(out, overwrite, read)
    if merged:
        counts = merge_into_pretrained(restored.module, restored.weights, out, dtype)
        if not (out / "config.json").is_file():
            restored.hf_model.config.save_pretrained(str(out))
        what = f"merged model ({counts['merged']} of {counts['tensors']} tensors merged"
        what += f", {dtype})" if dtype else ", in the pretrained files' dtypes)"
    else:
        if dtype is not None:
            raise ValueError("--dtype applies to --merged exports; the adapter keeps the dtype it trained in.")
        base_name = str(source.resolve()) if source is not None else None
        export_adapter(restored.module, out, base_model_name_or_path=base_name)
        what = "peft adapter directory"
    tokenizer = save_tokenizer(restored, out)
    tokenizer_note = f"tokenizer from {tokenizer}" if tokenizer else "no tokenizer found"
    return f"Wrote {what} to {out} from {restored.checkpoint} ({tokenizer_note})."


def with_config(checkpoint: Path, cli_args: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """``cli_args``, with the run's saved ``config.yaml`` in front when no ``--config`` is given."""
    if any(a == "--config" or a.startswith("--config=") for a in cli_args):
        return cli_args
    found = default_config(checkpoint)
    if found is None:
        parser.error(f"no --config given and no config.yaml in {checkpoint.parent.parent}: pass --config X.yaml.")
    return ["--config", str(found), *cli_args]


def config_files(cli_args: list[str]) -> dict[str, Path | None]:
    """The ``--config`` files among ``cli_args``, as ``{what: path}`` for the inputs ``--out`` must spare."""
    paths: list[Path] = []
    args = iter(cli_args)
    for arg in args:
        name, _, value = arg.partition("=")
        if name == "--config":
            paths.append(Path(value or next(args, "")))
    return {"config" if len(paths) == 1 else f"config {i + 1}": path for i, path in enumerate(paths)}


def main(args: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="pl-lowprec export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--ckpt_path", required=True, help="A Lightning checkpoint (adapter-only or full).")
    parser.add_argument("--out", required=True, help="The directory to write (must be empty, or --overwrite).")
    parser.add_argument("--merged", action="store_true", help="Merge into the original weights (default: adapter).")
    parser.add_argument("--dtype", default=None, help="Merged weights' dtype (default: the pretrained files').")
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="Replace a previous export in --out (never a file read).",
    )
    parsed, cli_args = parser.parse_known_args(args)
    checkpoint = Path(parsed.ckpt_path)
    check_checkpoint(checkpoint)
    cli_args = with_config(checkpoint, cli_args, parser)
    inputs = {"checkpoint": checkpoint, **config_files(cli_args)}
    refuse_inputs(Path(parsed.out), inputs)  # before the slow restore; the pretrained directory is checked after
    try:
        restored = restore(checkpoint, cli_args)
    except ConfigClassError as err:
        parser.exit(2, f"{parser.prog}: error: {err}\n")
    print(export(restored, Path(parsed.out), parsed.merged, parsed.dtype, parsed.overwrite, inputs))
