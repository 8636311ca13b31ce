"""A GGUF file as ``pl-lowprec generate --model`` reads it: through transformers' own GGUF loader, which
dequantizes every tensor to float32 and rebuilds the tokenizer from the file's metadata.

So ``generate`` answers, on the user's own prompts and with the same decoding, what a quantized export keeps of
the fine-tune before it goes to llama.cpp or Ollama: the weights and the tokenizer are the file's, the
arithmetic is PyTorch's (llama.cpp computes on the quantized blocks, so its logits differ in the last digits).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pl_lowprec._imports import gguf_missing


def is_gguf(path: str | Path) -> bool:
    return Path(path).suffix.lower() == ".gguf"


def check_gguf_file(path: Path) -> None:
    """``--model FILE.gguf``: a file, and the ``gguf`` package transformers reads it with."""
    if not path.is_file():
        what = "does not exist" if not path.exists() else "is not a file"
        raise FileNotFoundError(
            f"--model {str(path)!r} {what}: name a .gguf file that `pl-lowprec export --format gguf` wrote, or a"
            " directory that `pl-lowprec export` wrote (a merged model or a peft adapter)."
        )
    missing = gguf_missing()
    if missing is not None:
        raise ModuleNotFoundError(f"--model {str(path)!r} is a GGUF file, which transformers reads with {missing}")


def gguf_tokenizer(path: Path) -> Any:
    """The tokenizer the file holds (vocabulary, merges, special tokens and chat template), as transformers
    rebuilds it."""
    from transformers import AutoTokenizer  # optional (pl_lowprec[hf])

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"The tokenizer in {str(path)!r} has no EOS token, which ends every completion.")
    return tokenizer


def gguf_model(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    """The model the file holds, dequantized to ``dtype``."""
    from transformers import AutoModelForCausalLM  # optional (pl_lowprec[hf])

    return AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, local_files_only=True, dtype=dtype
    )
