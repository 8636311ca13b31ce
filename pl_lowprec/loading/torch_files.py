"""PyTorch weight files (``pytorch_model.bin``, its shards, a ``.pt``) read as safetensors files are read.

Many checkpoints on the hub are ``.bin`` only, and ``from_pretrained`` loads them. ``torch.load(mmap=True)``
maps the file instead of reading it, so a tensor's pages are read when the tensor is used, as with safetensors:
the streamed load still holds the model plus one tensor. ``weights_only=True`` stays: a pickle may run any
code when it is loaded, and one that holds more than plain tensors is refused, not trusted. A file in torch's
legacy format (saved before torch 1.6) cannot be mapped: it would be read whole, so it is refused with the
conversion.

Unpickling a file takes tens of milliseconds, so one load unpickles each file once (``sources.WeightFiles``) and
keeps it mapped, dropping each tensor's pages once it is consumed (``WeightFiles.release``).
"""

from __future__ import annotations

import pickle
import re
import zipfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch

TORCH_SUFFIXES = (".bin", ".pt", ".pth")
BIN_INDEX_NAME = "pytorch_model.bin.index.json"
BIN_SINGLE_NAME = "pytorch_model.bin"

# The names safetensors gives dtypes (``get_dtype()``), which every header reader here compares against.
SAFETENSORS_DTYPE = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}

_CONVERT = (
    "Convert it once where you trust it: AutoModelForCausalLM.from_pretrained(DIR).save_pretrained(DIR) writes"
    " model.safetensors beside it."
)


class _Slice:
    """What safetensors' ``get_slice`` gives the header readers: shape and dtype, no data read."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._tensor = tensor

    def get_shape(self) -> list[int]:
        return list(self._tensor.shape)

    def get_dtype(self) -> str:
        return SAFETENSORS_DTYPE.get(self._tensor.dtype, str(self._tensor.dtype).removeprefix("torch."))


class TorchWeights:
    """A state dict mapped from its file, with ``safe_open``'s methods (``keys``, ``get_slice``, ``get_tensor``,
    ``metadata``), so one loop reads either format."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._tensors = dict(tensors)

    def keys(self) -> list[str]:
        return list(self._tensors)

    def get_slice(self, key: str) -> _Slice:
        return _Slice(self._tensors[key])

    def get_tensor(self, key: str) -> torch.Tensor:
        return self._tensors[key]

    def metadata(self) -> dict[str, str]:
        return {"format": "pt"}


@contextmanager
def open_torch_file(file: Path) -> Iterator[TorchWeights]:
    """``torch.load(file, mmap=True, weights_only=True)``; refused, naming the file, where it is not a mappable
    state dict of tensors. The mapping is released when the handle and every tensor taken from it are gone."""
    if not zipfile.is_zipfile(file):
        size = file.stat().st_size if file.exists() else 0
        raise ValueError(
            f"{file} ({size:,} bytes) is not in torch's zip format: either it was saved by torch before 1.6 (a"
            " legacy file, which cannot be memory-mapped, so streaming it would read it whole) or it is cut short."
            f" {_CONVERT}"
        )
    try:
        loaded = torch.load(file, mmap=True, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as err:
        found = re.search(r"Unsupported global: GLOBAL [\w.]+|Unsupported operand \d+", str(err))
        what = found.group(0) if found else " ".join(str(err).split())[:200]
        raise ValueError(
            f"{file} holds more than plain tensors ({what}). It is read with weights_only=True because unpickling"
            " anything else can run arbitrary code, and pl_lowprec does not turn that off (nor does"
            " from_pretrained). Where you trust the file, keep its tensors only: torch.load(it, weights_only=False),"
            " then safetensors.torch.save_file(the dict of name -> tensor, 'model.safetensors')."
        ) from err
    except RuntimeError as err:
        raise ValueError(
            f"{file} could not be read as a torch file ({str(err).splitlines()[0][:200]}). A download or copy that"
            " was cut short does this: fetch or save the file again."
        ) from err
    bad = (
        [f"{type(loaded).__name__}"]
        if not isinstance(loaded, Mapping)
        else [k for k, v in loaded.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    )
    if bad:
        raise ValueError(
            f"{file} is not a state dict of tensors ({', '.join(map(str, bad[:4]))} is not a named tensor): a"
            " weights file maps parameter names to tensors (model.state_dict()). A training checkpoint nests it"
            " (e.g. under 'state_dict'): save that dict alone, or save_pretrained the model."
        )
    handle = TorchWeights(loaded)
    del loaded
    yield handle
