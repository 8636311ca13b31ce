"""The tokenizer of a pretrained model directory (or hub id), for the data, the checks and the exports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pl_lowprec.loading.hub import resolve_pretrained

# What AutoTokenizer reads a tokenizer from: a fast tokenizer, its config, or the files a slow one builds from.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)


def load_tokenizer(pretrained: str | Path) -> Any:
    """The tokenizer of a model directory (or hub id); a clear error when there is none or it lacks EOS."""
    from transformers import AutoTokenizer  # optional (pl_lowprec[hf])

    try:
        path = resolve_pretrained(pretrained, check_config=False)
    except ValueError as err:  # worded for the tokenizer, not for pretrained=
        raise ValueError(str(err).replace("pretrained=", "tokenizer=")) from None
    if path.is_dir() and not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"tokenizer={str(pretrained)!r} holds no tokenizer file ({', '.join(TOKENIZER_FILES)}): it is not a"
            " tokenizer directory (a directory with only config.json gives a model's shapes, not its tokenizer)."
            " Name the model's own tokenizer: the directory or hub id its weights come from."
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except (OSError, ValueError) as err:
        raise ValueError(f"tokenizer={str(pretrained)!r}: no tokenizer could be loaded from it ({err}).") from err
    if tokenizer.eos_token_id is None:
        raise ValueError(f"The tokenizer in {str(pretrained)!r} has no EOS token, which ends every sample.")
    return tokenizer
