"""Where pretrained tensors are: a safetensors file, a sharded directory, or a Hugging Face model directory.

A directory of ``pytorch_model.bin`` (or its shards and ``pytorch_model.bin.index.json``) is read as well, mapped
by ``torch_files.py``; where a directory holds both formats, safetensors is read, as ``from_pretrained`` does.

Only headers are read here (key, shape, dtype per tensor), so every check on names and shapes runs before a
single weight is loaded. ``prefix_map`` turns checkpoint keys into the module's keys: a LightningModule that
holds the Hugging Face model as ``self.model`` needs ``"model."`` in front of every checkpoint key.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, ExitStack, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pl_lowprec._imports import import_safetensors
from pl_lowprec._per_command import PerCommand
from pl_lowprec.loading.host_memory import release_mapped_pages
from pl_lowprec.loading.torch_files import (
    BIN_INDEX_NAME,
    BIN_SINGLE_NAME,
    TORCH_SUFFIXES,
    TorchWeights,
    open_torch_file,
)

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"

PrefixMap = dict[str, str]

_SHAPES_ONLY: ContextVar[bool] = ContextVar("shapes_only", default=False)


@contextmanager
def shapes_only() -> Iterator[None]:
    """While a config is read for its estimate or plan: a directory with only ``config.json`` stands in for the
    weights (the model is built from the config, nothing is loaded), as it does for ``CausalLM(pretrained=)``."""
    token = _SHAPES_ONLY.set(True)
    try:
        yield
    finally:
        _SHAPES_ONLY.reset(token)


def config_only(source: str | Path) -> bool:
    """A model directory with its ``config.json`` and no weights (a model's shapes, for an estimate)."""
    path = Path(source).expanduser()
    return path.is_dir() and (path / "config.json").is_file() and not has_weights(path)


def has_weights(directory: Path) -> bool:
    """Weights this package reads: safetensors, or ``pytorch_model.bin`` and its shards."""
    return any(directory.glob("*.safetensors")) or any(directory.glob("pytorch_model*.bin"))


def prefix_map(prefix: str | Mapping[str, str] | None) -> PrefixMap:
    """``"model."`` prepends to every key; ``{"model.": "net.model."}`` rewrites the keys that start with
    ``"model."`` (the longest matching prefix wins; ``""`` matches every key); ``None`` keeps keys as they are."""
    if prefix is None:
        return {}
    if isinstance(prefix, str):
        return {"": prefix}
    if not isinstance(prefix, Mapping) or not all(isinstance(k, str) and isinstance(v, str) for k, v in prefix.items()):
        raise TypeError(
            f"pretrained_prefix={prefix!r} must be a string (prepended to every checkpoint key, e.g. 'model.') or a"
            " mapping of checkpoint-key prefixes to module-key prefixes (e.g. {'model.': 'net.model.'})."
        )
    return dict(prefix)


def map_key(key: str, prefixes: PrefixMap) -> str:
    for old in sorted(prefixes, key=len, reverse=True):
        if key.startswith(old):
            return prefixes[old] + key[len(old) :]
    return key


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    key: str  # the key in the file
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype name: "BF16", "F32", ...


@dataclass(frozen=True)
class CheckpointIndex:
    """Every tensor of a checkpoint by module key (after the prefix map), read from the headers only."""

    source: Path
    tensors: dict[str, TensorInfo]

    @property
    def files(self) -> list[Path]:
        return sorted({t.file for t in self.tensors.values()})


def checkpoint_files(source: str | Path) -> list[Path]:
    """The weight files that make up ``source`` (safetensors preferred, else ``pytorch_model.bin`` or its shards);
    a clear error for anything else."""
    path = Path(source).expanduser()
    if path.is_file():
        if path.suffix != ".safetensors" and path.suffix not in TORCH_SUFFIXES:
            raise ValueError(
                f"pretrained={str(source)!r} is not a .safetensors file or a torch state dict (.bin, .pt, .pth)."
                f" {_ALLOWED}"
            )
        return [path]
    if not path.is_dir():
        raise FileNotFoundError(f"pretrained={str(source)!r} does not exist. {_ALLOWED}")
    if (path / INDEX_NAME).is_file():
        return indexed_files(path / INDEX_NAME)
    if (path / SINGLE_NAME).is_file():
        return [path / SINGLE_NAME]
    found = sorted(path.glob("*.safetensors"))
    if len(found) == 1:
        return found
    if (path / BIN_INDEX_NAME).is_file():
        return indexed_files(path / BIN_INDEX_NAME)
    if (path / BIN_SINGLE_NAME).is_file():
        return [path / BIN_SINGLE_NAME]
    others = other_weight_files(path)
    hint = (
        f" It holds {', '.join(others[:4])}: convert them to safetensors first (load the model once and call"
        " save_pretrained)."
        if others
        else ""
    )
    many = f" It holds {len(found)} .safetensors files but no index to tell which belong together." if found else ""
    raise FileNotFoundError(
        f"pretrained={str(source)!r} holds no {SINGLE_NAME}, {INDEX_NAME}, {BIN_SINGLE_NAME} or {BIN_INDEX_NAME}."
        f"{many}{hint} {_ALLOWED}"
    )


def indexed_files(index: Path) -> list[Path]:
    """The shards an index (``model.safetensors.index.json`` or ``pytorch_model.bin.index.json``) names, each once."""
    weight_map = json.loads(index.read_text()).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index} has no 'weight_map': it is not a weights index.")
    files = sorted({index.parent / name for name in weight_map.values()})
    absent = [f.name for f in files if not f.is_file()]
    if absent:
        raise FileNotFoundError(
            f"{index} names shards that are not in {index.parent}: {', '.join(absent)}. A download or copy that"
            " stopped early does this: fetch every file the index names (or save the model again)."
        )
    return files


def other_weight_files(source: str | Path) -> list[str]:
    """Weights in a format not read from a directory here (``.pt``, ``.pth``, a ``.bin`` not named
    ``pytorch_model``): named in the refusal, with the conversion."""
    path = Path(source).expanduser()
    return sorted(p.name for pattern in ("*.bin", "*.pt", "*.pth") for p in path.glob(pattern)) if path.is_dir() else []


_ALLOWED = (
    "Allowed: a .safetensors file (or a torch state dict: .bin, .pt, .pth), a directory with"
    " model.safetensors.index.json (or pytorch_model.bin.index.json) and its shards, or a Hugging Face model"
    " directory (save_pretrained)."
)


class WeightFiles:
    """The weight files of one load or export, each opened for reading by key. A safetensors file is opened with
    ``safe_open`` per use (that reads only its header); a torch file is mapped (``torch_files.open_torch_file``,
    which answers the same methods) once and kept until ``close``, as unpickling it took ~20 ms each time a module
    read from it; ``release`` drops a read tensor's pages from it."""

    def __init__(self) -> None:
        self._torch = ExitStack()
        self._opened: dict[Path, TorchWeights] = {}

    @contextmanager
    def open(self, file: Path, device: str | None = None) -> Iterator[Any]:
        if file.suffix == ".safetensors":
            with open_safetensors(file, device) as handle:
                yield handle
            return
        if file not in self._opened:
            self._opened[file] = self._torch.enter_context(open_torch_file(file))
        yield self._opened[file]

    def release(self, file: Path, key: str) -> None:
        """Drop the pages of ``key`` read from a kept torch file once it is consumed: the file stays mapped for the
        next module's tensors, and would otherwise keep every page read from it resident until the load ends (a
        safetensors handle is closed after each use)."""
        if file in self._opened:
            release_mapped_pages(self._opened[file].get_tensor(key))

    def close(self) -> None:
        self._opened.clear()
        self._torch.close()


_OPEN_FILES: PerCommand[WeightFiles] = PerCommand("weight_files", WeightFiles, WeightFiles.close)


def weight_files() -> AbstractContextManager[WeightFiles]:
    """The ``WeightFiles`` every read of pretrained weights inside this block opens its files through: those of a
    ``weight_files`` around it, else new ones, closed when it ends. An export restores the model (its load reads the
    base) and then merges into the same base files: a ``.bin`` shard is unpickled once for both (it was once each)."""
    return _OPEN_FILES.scope()


@contextmanager
def open_safetensors(file: Path, device: str | None = None) -> Iterator[Any]:
    """``safetensors.safe_open``; a file that is not a complete safetensors file fails naming it and its size."""
    safetensors = import_safetensors()
    kwargs = {"device": device} if device is not None else {}
    try:
        handle = safetensors.safe_open(str(file), framework="pt", **kwargs)
    except safetensors.SafetensorError as err:
        size = file.stat().st_size if file.exists() else 0
        reason = str(err).removeprefix("Error while deserializing header: ")
        raise ValueError(
            f"{file} ({size:,} bytes) is not a complete safetensors file: {reason}. A download or copy that was"
            " cut short does this: fetch or save the file again (its size should match the original)."
        ) from err
    with handle:
        yield handle


def resolve_checkpoint(
    source: str | Path, prefix: str | Mapping[str, str] | None = None, *, files: WeightFiles
) -> CheckpointIndex:
    """Read the headers of every file of ``source``; keys are mapped through ``prefix`` (see ``prefix_map``).
    ``files``: the load's open files, which keep a torch file unpickled for the tensors read next."""
    prefixes = prefix_map(prefix)
    tensors: dict[str, TensorInfo] = {}
    for file in checkpoint_files(source):
        with files.open(file) as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open is not a Mapping
                tensor = handle.get_slice(key)
                mapped = map_key(key, prefixes)
                if mapped in tensors:
                    raise ValueError(
                        f"Checkpoint keys {tensors[mapped].key!r} ({tensors[mapped].file.name}) and {key!r}"
                        f" ({file.name}) both map to {mapped!r}: check pretrained_prefix={prefix!r}."
                    )
                tensors[mapped] = TensorInfo(file, key, tuple(tensor.get_shape()), tensor.get_dtype())
    return CheckpointIndex(Path(source), tensors)


@dataclass(frozen=True)
class PretrainedWeights:
    """What to load into a module built on the meta device: ``path`` (see ``checkpoint_files``) and the
    ``prefix`` that turns its keys into the module's (see ``prefix_map``). Without ``prefix``, ``expected_prefix``
    is tried first (``CausalLM``'s ``"model."``), then the prefix under which every key fits. Checked when built."""

    path: str | Path
    prefix: str | Mapping[str, str] | None = None
    expected_prefix: str | None = None

    def __post_init__(self) -> None:
        prefix_map(self.prefix)
        if _SHAPES_ONLY.get() and config_only(self.path):
            return  # estimate/plan: the shapes are the config's, and no tensor is read
        try:
            checkpoint_files(self.path)
        except FileNotFoundError as err:
            if not config_only(self.path) or other_weight_files(self.path):
                raise  # its message names the weights there (.pt, .pth) and how to convert them
            raise FileNotFoundError(
                f"pretrained={str(self.path)!r} has a config.json but no weights: that is enough for `pl-lowprec"
                " estimate`, `pl-lowprec plan` and `estimate_memory` (the model's shapes), but training needs the"
                f" safetensors (or pytorch_model.bin) weights, which save_pretrained writes. {err}"
            ) from err
