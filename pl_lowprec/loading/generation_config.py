"""The ``generation_config.json`` of a model directory, as ``from_pretrained`` reads it.

A model built with ``from_config`` (its weights streamed in afterwards) gets a generation config derived from
``config.json`` alone: one EOS id where Llama-3.x-Instruct lists three, no ``repetition_penalty`` where
Qwen2.5-Instruct sets one. Its ``generate`` then stopped and scored differently from the same weights loaded with
``from_pretrained``, and ``pl-lowprec generate --ckpt_path`` from ``--model`` of the merged export (which copies
the file).

``generation_default`` is the one reader of a model's generation defaults: ``pl-lowprec generate`` takes its stop
ids (``stop_tokens``) and its sampling settings (``generate.Decoding``) from it.
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

GENERATION_CONFIG = "generation_config.json"


def load_generation_config(model: Any, directory: str | Path | None) -> bool:
    """Give ``model`` the generation config of ``directory`` where it has the file and ``model`` has only the one
    ``from_config`` derived; whether it did."""
    if directory is None or not (Path(directory) / GENERATION_CONFIG).is_file():
        return False
    current = getattr(model, "generation_config", None)
    if current is None or not getattr(current, "_from_model_config", False):
        return False  # set by from_pretrained or by the user: theirs stands
    from transformers import GenerationConfig  # optional (pl_lowprec[hf])

    try:
        model.generation_config = GenerationConfig.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError) as err:  # a file transformers cannot read must not stop a fit: it only generates
        unread = f"{Path(directory) / GENERATION_CONFIG} is not read ({err}): generate uses config.json's ids."
        warnings.warn(unread, stacklevel=2)
        return False
    return True


def generation_default(model: Any, name: str) -> Any:
    """The model's ``generation_config`` value of ``name`` (``eos_token_id``, ``temperature``, ...), what
    transformers' ``generate`` takes where the call does not set it; ``None`` where the model has none."""
    return getattr(getattr(model, "generation_config", None), name, None)
