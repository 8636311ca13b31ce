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
    check_gguf_whole(path)


GGUF_MAGIC = b"GGUF"


def starts_as_gguf(path: Path) -> bool:
    """Whether the file begins with GGUF's magic bytes."""
    with open(path, "rb") as file:
        return file.read(len(GGUF_MAGIC)) == GGUF_MAGIC


def check_gguf_whole(path: Path) -> None:
    """A GGUF file whose header reads and whose tensors lie within it: a copy cut short gave a Python traceback
    from the header's parser, or numpy's "cannot reshape array" from its tensor data."""
    import gguf

    size = path.stat().st_size
    again = "Copy it again, or write it again with `pl-lowprec export --format gguf`."
    if not starts_as_gguf(path):
        raise ValueError(
            f"--model {str(path)!r} is not a GGUF file: it does not begin with the bytes 'GGUF' ({size} bytes)."
            " Name a .gguf file that `pl-lowprec export --format gguf` wrote."
        )
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as err:  # struct.error, ValueError: the header or a tensor runs past the end of the file
        raise ValueError(
            f"--model {str(path)!r} is a GGUF file that does not read ({type(err).__name__}: {err}): most likely it"
            f" was cut short ({size} bytes). {again}"
        ) from err
    needed = max((t.data_offset + int(t.n_bytes) for t in reader.tensors), default=0)
    if needed > size:
        raise ValueError(f"--model {str(path)!r} is cut short: {size} bytes, and its tensors need {needed}. {again}")


def gguf_tokenizer(path: Path) -> Any:
    """The tokenizer the file holds (vocabulary, merges, special tokens and chat template), as transformers
    rebuilds it."""
    from transformers import AutoTokenizer  # optional (pl_lowprec[hf])

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"The tokenizer in {str(path)!r} has no EOS token, which ends every completion.")
    return tokenizer


def gguf_model(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    """The model the file holds, dequantized to ``dtype``, with the file's ``rope_freqs`` applied."""
    from transformers import AutoModelForCausalLM  # optional (pl_lowprec[hf])

    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, local_files_only=True, dtype=dtype
    )
    apply_rope_freqs(model, path)
    return model


ROPE_FREQS = "rope_freqs.weight"


def apply_rope_freqs(model: Any, path: Path) -> bool:
    """Divide the model's rotary frequencies by the file's ``rope_freqs`` (Llama 3's ``rope_type: llama3``
    scaling, which llama.cpp applies from that tensor); whether the file had one.

    transformers' GGUF reader ignores the tensor and computes with the default frequencies: every position past
    the first differed from llama.cpp and from the merged model (logits off by 0.016 at 4,096 tokens on a 2-layer
    Llama-3.2 shape with random weights, more where the weights use those frequencies)."""
    import gguf

    tensors = [t for t in gguf.GGUFReader(str(path)).tensors if t.name == ROPE_FREQS]
    if not tensors:
        return False
    factors = torch.from_numpy(tensors[0].data.astype("float32").reshape(-1).copy())
    rotaries = [m for m in model.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)]
    for rotary in rotaries:
        if rotary.inv_freq.shape != factors.shape:
            raise ValueError(
                f"{str(path)!r}: {ROPE_FREQS} has {factors.numel()} factors and the model's rotary embedding"
                f" {rotary.inv_freq.numel()} frequencies; the file does not describe this model."
            )
        scaled = rotary.inv_freq / factors.to(rotary.inv_freq.device, rotary.inv_freq.dtype)
        rotary.inv_freq = scaled
        if isinstance(getattr(rotary, "original_inv_freq", None), torch.Tensor):
            rotary.original_inv_freq = scaled.clone()
    return True
