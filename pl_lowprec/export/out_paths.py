"""Where ``export`` and ``generate`` may write: never over what they read, and over nothing else unless asked.

A command reads a checkpoint, a config, a pretrained directory, a tokenizer, a prompts file. ``--out`` may not be
one of them, hold one of them, or (for an existing path) lie inside one, even with ``--overwrite``. Otherwise an
existing ``--out`` needs ``--overwrite``, and an export directory is only emptied when every file in it is one an
export writes (or the temporary merged directory of a GGUF export that was killed): a directory that also holds a
``.ckpt``, data or anything else is not a previous export. A merged export also copies the pretrained directory's
other files (LICENSE, .gitattributes, ...): a file byte for byte the same as the pretrained one of its name is
one the export writes again, so nothing is lost.
"""

from __future__ import annotations

import filecmp
import re
import shutil
from pathlib import Path

from pl_lowprec.export.gguf_types import GGUF_TYPES

# What save_pretrained writes for a model, an adapter or a tokenizer (and nothing a run or a user keeps).
EXPORT_FILE = re.compile(
    r"(model|adapter_model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?"
    r"|config\.json|generation_config\.json|adapter_config\.json|README\.md"
    r"|tokenizer\.json|tokenizer_config\.json|special_tokens_map\.json|added_tokens\.json"
    r"|vocab\.json|merges\.txt|tokenizer\.model|chat_template\.(jinja|json)"
    rf"|model-({'|'.join(GGUF_TYPES)})\.gguf|Modelfile|quantized_model\.pt"
)
# The merged model a GGUF export converts from, left behind only if the export was killed before it finished.
EXPORT_DIR = re.compile(r"\.merged-[\w-]+")


def refuse_inputs(out: Path, inputs: dict[str, Path | None]) -> None:
    """``ValueError`` when ``out`` is, holds, or (existing) lies inside one of ``inputs`` (``{what: path}``)."""
    resolved = out.resolve()
    for what, path in inputs.items():
        if path is None:
            continue
        source = Path(path).resolve()
        holds = resolved == source or resolved in source.parents
        inside = out.exists() and source.is_dir() and source in resolved.parents
        if holds or inside:
            relation = "is" if resolved == source else "holds" if holds else "lies inside"
            raise ValueError(
                f"--out {str(out)!r} {relation} the {what} this command reads ({str(path)!r}); writing there would"
                " destroy it, so no flag allows it (not even --overwrite). Name a new path for --out."
            )


def check_out_dir(out: Path, overwrite: bool, inputs: dict[str, Path | None], pretrained_known: bool = True) -> None:
    """``ValueError`` naming everything that stops ``prepare_out_dir`` at once, before anything is loaded or
    written: ``out`` is an input, a file, or a non-empty directory without ``overwrite`` or that no export wrote.
    ``pretrained_known=False`` (before the config is read): other files beside an export's may be its copies of the
    pretrained directory's, and are judged later, by the call that knows it (``inputs["pretrained weights"]``)."""
    refuse_inputs(out, inputs)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {str(out)!r} is a file; name a directory.")
    if not out.is_dir() or not any(out.iterdir()):
        return
    source = inputs.get("pretrained weights")
    copies_from = Path(source) if source is not None and Path(source).is_dir() else None
    foreign = sorted(c.name for c in out.iterdir() if not written_by_export(c, copies_from))
    shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
    if foreign and not pretrained_known and len(foreign) < len(list(out.iterdir())):
        return  # beside an export's files they may be its copies: judged once the pretrained directory is known
    if foreign:
        flag = "--overwrite will not empty it" if overwrite else "--overwrite would not empty it either"
        raise ValueError(
            f"--out {str(out)!r} exists and holds {shown}, which no export writes: it is not a previous export, so"
            f" {flag}. Name a new directory, or move those out first."
        )
    if not overwrite:
        raise ValueError(
            f"--out {str(out)!r} exists and is not empty: pass --overwrite to replace its contents (a previous"
            " export), or name a new directory."
        )


def written_by_export(path: Path, copies_from: Path | None = None) -> bool:
    """A file an export writes (or copies unchanged from the pretrained directory ``copies_from``), or the merged
    directory a killed GGUF export left (holding only such files)."""
    if path.is_dir():
        return bool(EXPORT_DIR.fullmatch(path.name)) and all(
            c.is_file() and written_by_export(c, copies_from) for c in path.iterdir()
        )
    if EXPORT_FILE.fullmatch(path.name):
        return True
    copied = copies_from / path.name if copies_from is not None else None
    return copied is not None and copied.is_file() and filecmp.cmp(path, copied, shallow=False)


def prepare_out_dir(out: Path, overwrite: bool, inputs: dict[str, Path | None]) -> None:
    """An empty ``out`` directory; a previous export is replaced only with ``overwrite`` (``check_out_dir``)."""
    check_out_dir(out, overwrite, inputs)
    if out.is_dir() and any(out.iterdir()):
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)


def prepare_out_file(out: Path, overwrite: bool, inputs: dict[str, Path | None]) -> None:
    """``out`` may be written: new, or an existing file replaced with ``overwrite``."""
    refuse_inputs(out, inputs)
    if out.is_dir():
        raise ValueError(f"--out {str(out)!r} is a directory; name a .jsonl file.")
    if out.exists() and not overwrite:
        raise ValueError(f"--out {str(out)!r} exists: pass --overwrite to replace it, or name a new file.")
