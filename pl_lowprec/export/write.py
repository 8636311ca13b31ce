"""What ``pl-lowprec export`` writes: a restored module as a peft adapter directory or a merged model, with the
training data's tokenizer."""

from __future__ import annotations

from pathlib import Path

from pl_lowprec.adapters import export_adapter
from pl_lowprec.export.merged import merge_into_pretrained
from pl_lowprec.export.out_paths import check_out_dir, prepare_out_dir
from pl_lowprec.export.restore import Restored
from pl_lowprec.loading import PretrainedWeights
from pl_lowprec.loading.hub import hub_id_of
from pl_lowprec.loading.tokenizer import load_tokenizer
from pl_lowprec.transforms.dtypes import to_dtype

MERGED_DTYPES = ("float32", "bfloat16", "float16")

FORMATS = ("adapter", "merged", "gguf")


def choose_format(export_format: str | None, merged: bool, gguf_type: str | None) -> str:
    """``--format`` reconciled with ``--merged`` and ``--gguf_type``: adapter unless one asks for another."""
    if export_format is not None and export_format not in FORMATS:
        raise ValueError(f"--format {export_format!r} is not one of {', '.join(FORMATS)}.")
    if merged and export_format not in (None, "merged"):
        raise ValueError(
            f"--merged asks for a merged model directory and --format {export_format} for another export; pass"
            " one of them (--format gguf is merged too: it writes the merged weights as one GGUF file)."
        )
    chosen = export_format or ("merged" if merged else "adapter")
    if gguf_type is not None and chosen != "gguf":
        raise ValueError(f"--gguf_type {gguf_type} applies to --format gguf, and this export is --format {chosen}.")
    return chosen


def pretrained_dir(restored: Restored) -> Path | None:
    """The model directory the pretrained weights came from (config, tokenizer), if they came from one."""
    if restored.weights is None:
        return None
    path = Path(restored.weights.path)
    return path if path.is_dir() else None


def save_tokenizer(restored: Restored, out: Path) -> str | None:
    """The training data's tokenizer (else the pretrained directory's), saved into ``out``; where it came from."""
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


def saved_tokenizer_note(source: str | None) -> str:
    """What an export's line says of the tokenizer ``save_tokenizer`` saved."""
    return f"tokenizer from {source}" if source else "no tokenizer found"


def read_paths(
    checkpoint: Path, weights: PretrainedWeights | None, tokenizer_dir: str | None, inputs: dict | None = None
) -> dict[str, Path | None]:
    """What an export reads (``{what: path}``), which ``--out`` may never be, hold or lie inside."""
    return {
        "checkpoint": checkpoint,
        **(inputs or {}),
        "pretrained weights": Path(weights.path) if weights is not None else None,
        "tokenizer directory": Path(tokenizer_dir) if tokenizer_dir else None,
    }


def check_dtype(dtype: str | None, merged: bool) -> None:
    """``--dtype``: a floating dtype, and only for a merged export."""
    if dtype is None:
        return
    if not merged:
        raise ValueError("--dtype applies to --merged exports; the adapter keeps the dtype it trained in.")
    try:
        floating = to_dtype(dtype).is_floating_point
    except ValueError:
        floating = False
    if not floating:
        raise ValueError(
            f"--dtype {dtype!r} is not a dtype for merged weights: give one of {', '.join(MERGED_DTYPES)}, or leave"
            " it out to keep each tensor's dtype in the pretrained files."
        )


def check_merge_base(weights: PretrainedWeights | None, asked: str = "--merged") -> None:
    """A merge (``--merged``, ``--format gguf``: ``asked``, as the command line said it) adds the adapters to the
    original weights: the config names them."""
    if weights is None:
        what = "A GGUF export merges" if "gguf" in asked else "A merged export adds"
        raise ValueError(
            f"{what} the adapters into the original pretrained weights, and this config names none"
            " (CausalLM(pretrained=...) or the strategy's pretrained=): its base was built from a config with"
            f" random or seeded weights. Export the adapter directory instead (leave out {asked})."
        )


def check_export(
    out: Path,
    merged: bool,
    dtype: str | None,
    overwrite: bool,
    read: dict[str, Path | None],
    weights: PretrainedWeights | None,
    asked: str = "--merged",
) -> None:
    """Every refusal of an export that is known before the model loads (``pl-lowprec export`` checks them then);
    ``asked``: the merge as the command line asked for it."""
    check_dtype(dtype, merged)
    if merged:
        check_merge_base(weights, asked)
    check_out_dir(out, overwrite, read)


def check_merged(restored: Restored, asked: str = "--merged") -> None:
    """A merge needs the original weights, and a config to go with them; the config's source is known only once
    the module is restored (its Hugging Face model). Refused before anything is written."""
    check_merge_base(restored.weights, asked)
    if pretrained_dir(restored) is None and restored.hf_model is None:
        raise ValueError(
            f"pretrained={str(restored.weights.path)!r} is a single file and the module holds no Hugging Face"
            " model whose config could go with the merged weights. Point pretrained= at a model directory."
        )


def export(
    restored: Restored, out: Path, merged: bool, dtype: str | None, overwrite: bool, inputs: dict | None = None
) -> str:
    """Write the export and return a one-line summary; ``inputs`` (``{what: path}``) are never written over."""
    source = pretrained_dir(restored)
    read = read_paths(restored.checkpoint, restored.weights, restored.tokenizer_dir, inputs)
    check_export(out, merged, dtype, overwrite, read, restored.weights)
    if merged:
        check_merged(restored)
    prepare_out_dir(out, overwrite, read)
    if merged:
        counts = merge_into_pretrained(restored.module, restored.weights, out, dtype)
        if not (out / "config.json").is_file():
            restored.hf_model.config.save_pretrained(str(out))
        what = f"merged model ({counts['merged']} of {counts['tensors']} tensors merged"
        what += f", {counts['whole']} as they trained" if counts["whole"] else ""
        what += f", {counts['left_out']} of a head the model lacks left out" if counts["left_out"] else ""
        what += f", {dtype})" if dtype else ", in the pretrained files' dtypes)"
    else:
        # a hub id's download is recorded as the id, as peft records a base loaded by its id
        base_name = (hub_id_of(source) or str(source.resolve())) if source is not None else None
        export_adapter(restored.module, out, base_model_name_or_path=base_name)
        what = "peft adapter directory"
    tokenizer_note = saved_tokenizer_note(save_tokenizer(restored, out))
    unnamed_base = unnamed_base_note(restored, merged, out)
    return f"Wrote {what} to {out} from {restored.checkpoint} ({tokenizer_note}).{unnamed_base}"


def unnamed_base_note(restored: Restored, merged: bool, out: Path) -> str:
    """Where an adapter's base came from no pretrained weights, what its ``adapter_config.json`` cannot say: the
    base is the model the module builds from its config, and the adapters load onto that."""
    if merged or restored.weights is not None:
        return ""
    module = type(restored.module)
    return (
        f" Its base was built from the config ({module.__module__}.{module.__qualname__} with its seeded or random"
        " weights), not loaded from pretrained weights, so adapter_config.json names no base_model_name_or_path:"
        f" build the same module and load the adapters onto its model, PeftModel.from_pretrained(model, {str(out)!r})."
    )
