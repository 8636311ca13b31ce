"""A Hugging Face model directory (a merged export) written as one GGUF file for llama.cpp and Ollama.

What ``convert_hf_to_gguf.py`` does for the architectures of ``gguf_arch``, with the ``gguf`` package's writer:
the hyperparameters, the tokenizer and chat template (``gguf_vocab``), then every tensor under its llama.cpp name
in the type ``gguf_types`` chooses. The tensors are streamed: their names, shapes and types are written first
(from the safetensors headers, or a mapped ``pytorch_model.bin``), then each is loaded, converted and written in
turn, so the peak is one tensor, not the model (llama.cpp's converter gets the same from lazy tensors). A
``pytorch_model.bin`` is unpickled once for all of that, and for each further type of the same export, as the
streamed load reads it (``loading.sources.WeightFiles``, each tensor's pages dropped once written).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from itertools import groupby
from pathlib import Path
from typing import Any

import numpy as np

from pl_lowprec._imports import import_gguf
from pl_lowprec.export.gguf_arch import (
    SKIPPED_SUFFIXES,
    Architecture,
    add_hyperparameters,
    architecture,
    llama3_rope_factors,
    permute_qk,
)
from pl_lowprec.export.gguf_types import K_MIXES, MixModel, encode, file_type, stored_as, tensor_types
from pl_lowprec.export.gguf_vocab import add_vocabulary
from pl_lowprec.loading.sources import WeightFiles, checkpoint_files, weight_files


@dataclass(frozen=True)
class Planned:
    """One tensor of the GGUF: where it is read from (None: computed), its GGUF name, shape and type."""

    gguf_name: str
    shape: tuple[int, ...]
    qtype: Any
    file: Path | None = None
    key: str | None = None


def model_config(model_dir: Path) -> Any:
    from transformers import AutoConfig  # optional (pl_lowprec[hf]), as for every export

    return AutoConfig.from_pretrained(str(model_dir), local_files_only=True)


def model_weight_files(model_dir: Path) -> list[Path]:
    """The weight files of ``model_dir`` as the streamed load finds them (safetensors preferred, else
    ``pytorch_model.bin`` or its shards), in the order of their names, which is the order of the shards."""
    try:
        return checkpoint_files(model_dir)
    except FileNotFoundError as err:
        raise ValueError(f"{str(model_dir)!r} holds no weights to convert to GGUF: {err}") from err


def auto_type(model_dir: Path, files: WeightFiles) -> str:
    """``--gguf_type auto``: bf16 for bf16 weights, else f16 (llama.cpp's converter reads the first matrix too)."""
    with files.open(model_weight_files(model_dir)[0]) as handle:
        for key in handle.keys():  # noqa: SIM118 - safe_open is not a Mapping
            tensor = handle.get_slice(key)
            if len(tensor.get_shape()) >= 2:
                return "bf16" if tensor.get_dtype() == "BF16" else "f16"
    return "f16"


def plan(
    gguf: Any, model_dir: Path, config: Any, arch: Architecture, gguf_type: str, files: WeightFiles
) -> list[Planned]:
    """Every tensor the file will hold, from the files' headers (nothing is loaded)."""

    def headers() -> Iterator[tuple[Path, str, tuple[int, ...]]]:
        for file in model_weight_files(model_dir):
            with files.open(file) as handle:
                for key in handle.keys():  # noqa: SIM118 - safe_open is not a Mapping
                    yield file, key, tuple(handle.get_slice(key).get_shape())

    return plan_tensors(gguf, headers(), config, arch, gguf_type)


def plan_tensors(
    gguf: Any,
    sources: Iterable[tuple[Path | None, str, tuple[int, ...]]],
    config: Any,
    arch: Architecture,
    gguf_type: str,
) -> list[Planned]:
    """Every tensor the file will hold, from each checkpoint tensor's (file, key, shape): its GGUF name, and its
    type, chosen once every tensor is known (a k-quant mix counts layers)."""
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.gguf_arch), config.num_hidden_layers)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    planned: list[Planned] = []
    factors = llama3_rope_factors(config)
    if factors is not None:
        name = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight"
        planned.append(Planned(name, factors.shape, None))
    for file, key, shape in sources:
        if key.endswith(SKIPPED_SUFFIXES) or (tied and key == "lm_head.weight"):
            continue
        base, _, suffix = key.rpartition(".")
        gguf_base = names.get_name(base)
        if gguf_base is None:
            raise ValueError(
                f"{file.name if file else 'The model'} holds {key!r}, which llama.cpp's {arch.gguf_arch.lower()} has"
                f" no tensor for: the GGUF could not compute what this {arch.model_type} model computes. Export"
                " --format merged."
            )
        planned.append(Planned(f"{gguf_base}.{suffix}", shape, None, file, key))
    tensors = [(item.gguf_name, item.shape) for item in planned]
    types = tensor_types(gguf, gguf_type, tensors, mix_model(config, arch))
    return [replace(item, qtype=qtype) for item, qtype in zip(planned, types, strict=True)]


def k_fallbacks(planned: list[Planned]) -> dict[str, Any]:
    """The matrices whose rows do not split into 256-value super-blocks (so a k-quant mix writes each in its
    type's fallback, or F16): ``rows`` (row width -> how many) and the ``types`` they were written in."""
    odd = [item for item in planned if item.qtype.name != "F32" and item.shape[-1] % 256]
    widths = Counter(item.shape[-1] for item in odd)
    return {"rows": dict(sorted(widths.items())), "types": sorted({item.qtype.name for item in odd})}


def mix_model(config: Any, arch: Architecture) -> MixModel:
    """What ``llama-quantize`` reads from the model for its mixes: the layers, the query heads per KV head, and
    whether it takes the model for a 70B (``LLM_TYPE_70B``: 80 layers, and grouped KV heads for llama)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    layers = config.num_hidden_layers
    seventy_b = layers == 80 and (arch.gguf_arch == "QWEN2" or kv_heads != heads)
    return MixModel(layers, heads // kv_heads, seventy_b)


def tensor_values(planned: list[Planned], config: Any, arch: Architecture, files: WeightFiles) -> Iterator[np.ndarray]:
    """Each planned tensor as float32 values in llama.cpp's layout, one file open at a time."""
    for file, items in groupby(planned, key=lambda item: item.file):
        if file is None:
            yield from (llama3_rope_factors(config) for _ in items)
            continue
        with files.open(file) as handle:
            for item in items:
                yield permute_qk(item.key, handle.get_tensor(item.key).float().numpy(), config, arch)
                files.release(file, item.key)  # written: a kept .bin mapping gives back its pages


def writing_progress(out_file: Path, total: int) -> Any:
    """A bar of the bytes written, with the tensor being quantized, on stderr where it is a terminal (a k-quant
    export of an 8B model runs for minutes, as llama.cpp's converter and llama-quantize show theirs)."""
    from tqdm import tqdm  # a dependency of the gguf package

    return tqdm(total=total, unit="B", unit_scale=True, desc=f"Writing {out_file.name}", disable=None, leave=False)


def convert_to_gguf(model_dir: Path, out_file: Path, gguf_type: str, name: str) -> dict[str, Any]:
    """Write ``model_dir`` (config, safetensors or .bin, tokenizer) to ``out_file``; return what was written. The
    weight files are those of the command's scope where one is open (a .bin is unpickled once for every type)."""
    with weight_files() as files:
        return written_gguf(model_dir, out_file, gguf_type, name, files)


def written_gguf(model_dir: Path, out_file: Path, gguf_type: str, name: str, files: WeightFiles) -> dict[str, Any]:
    """``convert_to_gguf`` with the open weight files it reads."""
    gguf = import_gguf()
    model_dir = Path(model_dir)
    config = model_config(model_dir)
    arch = architecture(config)
    planned = plan(gguf, model_dir, config, arch, gguf_type, files)
    writer = gguf.GGUFWriter(str(out_file), gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, arch.gguf_arch)])
    parameters = sum(int(np.prod(item.shape)) for item in planned if item.file is not None)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    writer.add_size_label(gguf.size_label(parameters, parameters, 0, 0))
    add_hyperparameters(writer, gguf, config, arch, file_type(gguf, gguf_type))
    vocab = add_vocabulary(writer, gguf, model_dir, config.vocab_size)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    sizes = []
    for item in planned:
        shape, dtype, nbytes = stored_as(gguf, item.shape, item.qtype)
        writer.add_tensor_info(item.gguf_name, shape, dtype, nbytes, raw_dtype=item.qtype)
        sizes.append(nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    try:
        with writing_progress(out_file, sum(sizes)) as progress:
            for item, nbytes, values in zip(planned, sizes, tensor_values(planned, config, arch, files), strict=True):
                progress.set_postfix_str(f"{item.gguf_name} {item.qtype.name}")
                writer.write_tensor_data(encode(gguf, values, item.qtype))
                progress.update(nbytes)
    finally:
        writer.close()
    return {
        "architecture": arch.gguf_arch.lower(),
        "tensors": len(planned),
        "types": Counter(item.qtype.name for item in planned),
        "k_fallbacks": k_fallbacks(planned) if gguf_type in K_MIXES else {"rows": {}, "types": []},
        "parameters": parameters,
        "vocab": vocab,
        "config": config,
    }
