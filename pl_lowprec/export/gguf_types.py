"""``--gguf_type``: the GGML type each tensor is written in, chosen as llama.cpp's converter chooses it.

``convert_hf_to_gguf.prepare_tensors`` writes 1-D tensors and norms in F32 and every other weight in the file's
type, falling back to F16 where a row does not divide into the type's blocks (32 values for Q8_0 and Q4_0).
``q4_0`` is not one of the converter's types (llama.cpp makes it with ``llama-quantize``, which keeps the output
matrix at Q6_K); here the output matrix (the embedding where they are tied) is kept at Q8_0, the widest type the
``gguf`` package's quantizer writes, and every other matrix is Q4_0.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# --gguf_type -> (the GGMLQuantizationType of matrices, the LlamaFileType of general.file_type)
GGUF_TYPES = {
    "bf16": ("BF16", "MOSTLY_BF16"),
    "f16": ("F16", "MOSTLY_F16"),
    "q8_0": ("Q8_0", "MOSTLY_Q8_0"),
    "q4_0": ("Q4_0", "MOSTLY_Q4_0"),
}


def check_gguf_type(gguf_type: str) -> None:
    if gguf_type not in GGUF_TYPES:
        raise ValueError(
            f"--gguf_type {gguf_type!r} is not one this export writes: choose {', '.join(GGUF_TYPES)} (bf16 keeps a"
            " bf16 model exactly; q8_0 is about half its size; q4_0 about a quarter, with a larger error)."
        )


def file_type(gguf: Any, gguf_type: str) -> int:
    return int(getattr(gguf.LlamaFileType, GGUF_TYPES[gguf_type][1]))


def tensor_type(gguf: Any, gguf_type: str, name: str, shape: tuple[int, ...], output_matrix: bool) -> Any:
    """The GGML type of one tensor (``name`` is its GGUF name); ``output_matrix`` for the one that makes logits."""
    kinds = gguf.GGMLQuantizationType
    if len(shape) <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return kinds.F32
    wanted = getattr(kinds, GGUF_TYPES[gguf_type][0])
    if wanted == kinds.Q4_0 and output_matrix:
        wanted = kinds.Q8_0
    block = gguf.GGML_QUANT_SIZES[wanted][0]
    return wanted if shape[-1] % block == 0 else kinds.F16


def stored_as(gguf: Any, shape: tuple[int, ...], qtype: Any) -> tuple[tuple[int, ...], Any, int]:
    """What ``GGUFWriter.add_tensor_info`` takes for a tensor of logical ``shape`` written as ``qtype``: the array
    shape and dtype ``encode`` returns, and its size in bytes (known before the tensor is loaded)."""
    kinds = gguf.GGMLQuantizationType
    if qtype in (kinds.F32, kinds.F16):
        dtype = np.dtype(np.float32 if qtype == kinds.F32 else np.float16)
        return shape, dtype, int(np.prod(shape)) * dtype.itemsize
    byte_shape = tuple(gguf.quant_shape_to_byte_shape(shape, qtype))
    return byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape))


def encode(gguf: Any, values: np.ndarray, qtype: Any) -> np.ndarray:
    """``values`` (float32) in ``qtype``: F32/F16 arrays, or the bytes of BF16 and the block types."""
    return gguf.quants.quantize(np.ascontiguousarray(values, dtype=np.float32), qtype)
