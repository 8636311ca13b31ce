"""``--gguf_type``: the GGML type each tensor is written in, chosen as llama.cpp chooses it.

``convert_hf_to_gguf.prepare_tensors`` writes 1-D tensors and norms in F32 and every other weight in the file's
type, falling back to F16 where a row does not divide into the type's blocks (32 values for Q8_0 and Q4_0).

``q4_k_m``, ``q5_k_m`` and ``q6_k`` are ``llama-quantize``'s mixes, chosen per tensor as its
``llama_tensor_get_type`` chooses them for these architectures (``src/llama-quant.cpp``), in the order its model
loader keeps the tensors (``weight_name_comparer``: the others, then each block's, by layer and name): the
output matrix (the embedding where they are tied) Q6_K, or Q8_0 where its rows do not split into 256-value
super-blocks; ``attn_v`` and ``ffn_down`` Q6_K in the layers ``use_more_bits`` picks
(the first and last eighth, and every third between) for Q4_K_M and Q5_K_M; ``attn_v`` Q5_K on a 70B model;
and where a row does not split into 256 values, the type's 32-value fallback (Q4_K: Q5_0, Q5_K: Q5_1, Q6_K:
Q8_0), else F16. The k-quant blocks are written by ``gguf_kquants`` as ggml writes them.

``q4_0`` is not one of the converter's types either (``llama-quantize`` keeps its output matrix at Q6_K); here
that matrix is kept at Q8_0, and every other matrix is Q4_0.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from pl_lowprec.export.gguf_kquants import QUANTIZERS, quantize_k

# --gguf_type -> (the GGMLQuantizationType of matrices, the LlamaFileType of general.file_type)
GGUF_TYPES = {
    "bf16": ("BF16", "MOSTLY_BF16"),
    "f16": ("F16", "MOSTLY_F16"),
    "q8_0": ("Q8_0", "MOSTLY_Q8_0"),
    "q6_k": ("Q6_K", "MOSTLY_Q6_K"),
    "q5_k_m": ("Q5_K", "MOSTLY_Q5_K_M"),
    "q4_k_m": ("Q4_K", "MOSTLY_Q4_K_M"),
    "q4_0": ("Q4_0", "MOSTLY_Q4_0"),
}
K_MIXES = ("q6_k", "q5_k_m", "q4_k_m")
MORE_BITS = ("q4_k_m", "q5_k_m")  # attn_v and ffn_down at Q6_K in the layers use_more_bits picks
FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}  # llama.cpp's tensor_type_fallback


def check_gguf_type(gguf_type: str) -> None:
    if gguf_type not in GGUF_TYPES:
        raise ValueError(
            f"--gguf_type {gguf_type!r} is not one this export writes: choose {', '.join(GGUF_TYPES)} (bf16 keeps a"
            " bf16 model exactly; q8_0 is about half its size; q4_k_m, Ollama's default, about 30%, as llama-quantize"
            " writes it)."
        )


def file_type(gguf: Any, gguf_type: str) -> int:
    return int(getattr(gguf.LlamaFileType, GGUF_TYPES[gguf_type][1]))


def _is_matrix(name: str, shape: tuple[int, ...]) -> bool:
    return len(shape) >= 2 and name.endswith(".weight") and not name.endswith("_norm.weight")


def tensor_types(
    gguf: Any, gguf_type: str, tensors: Sequence[tuple[str, tuple[int, ...]]], layers: int, seventy_b: bool
) -> list[Any]:
    """The GGML type of each of ``tensors`` (GGUF name and shape): a k-quant mix as ``llama-quantize`` chooses it,
    or one type for every matrix, as llama.cpp's converter writes it."""
    if gguf_type in K_MIXES:
        return k_mix_types(gguf, gguf_type, tensors, layers, seventy_b)
    tied = not any(name == "output.weight" for name, _ in tensors)
    return [single_type(gguf, gguf_type, name, shape, _is_output(name, tied)) for name, shape in tensors]


def _is_output(name: str, tied: bool) -> bool:
    """The matrix that makes the logits: ``output.weight``, or the embedding where the file has none."""
    return name == "output.weight" or (tied and name == "token_embd.weight")


def single_type(gguf: Any, gguf_type: str, name: str, shape: tuple[int, ...], output_matrix: bool) -> Any:
    """The GGML type of one tensor of a single-type file (``name`` is its GGUF name); ``output_matrix`` for the
    one that makes logits."""
    kinds = gguf.GGMLQuantizationType
    if not _is_matrix(name, shape):
        return kinds.F32
    wanted = getattr(kinds, GGUF_TYPES[gguf_type][0])
    if wanted == kinds.Q4_0 and output_matrix:
        wanted = kinds.Q8_0
    block = gguf.GGML_QUANT_SIZES[wanted][0]
    return wanted if shape[-1] % block == 0 else kinds.F16


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers that get more bits: the first and last eighth, and every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def k_mix_types(
    gguf: Any, gguf_type: str, tensors: Sequence[tuple[str, tuple[int, ...]]], layers: int, seventy_b: bool
) -> list[Any]:
    """The type of each of ``tensors`` (GGUF name and shape) in ``llama-quantize``'s mix."""
    kinds = gguf.GGMLQuantizationType
    default = GGUF_TYPES[gguf_type][0]
    tied = not any(name == "output.weight" for name, _ in tensors)  # llama.cpp's has_tied_embeddings
    values_heads = sum("attn_v.weight" in name for name, _ in tensors)
    value_index = down_index = 0
    chosen = [kinds.F32] * len(tensors)
    for position in sorted(range(len(tensors)), key=lambda i: _loader_order(tensors[i][0])):
        name, shape = tensors[position]
        if not _is_matrix(name, shape):
            continue
        wanted = default
        if _is_output(name, tied):
            wanted = "Q8_0" if shape[-1] % gguf.GGML_QUANT_SIZES[getattr(kinds, default)][0] else "Q6_K"
        elif "attn_v.weight" in name:
            if gguf_type in MORE_BITS and use_more_bits(value_index, values_heads):
                wanted = "Q6_K"
            if seventy_b and wanted == "Q4_K":  # llama.cpp's LLM_TYPE_70B: its attn_v is 8x smaller than attn_q
                wanted = "Q5_K"
            value_index += 1
        elif "ffn_down" in name:
            if gguf_type in MORE_BITS and use_more_bits(down_index, layers):
                wanted = "Q6_K"
            down_index += 1
        for candidate in (wanted, FALLBACK.get(wanted, wanted), "F16"):
            if shape[-1] % gguf.GGML_QUANT_SIZES[getattr(kinds, candidate)][0] == 0:
                break
        chosen[position] = getattr(kinds, candidate)
    return chosen


def _loader_order(name: str) -> tuple[int, str]:
    """llama.cpp's ``weight_name_comparer``: tensors outside the blocks first, then by layer number, then name."""
    parts = name.split(".")
    return (int(parts[1]) if parts[0] == "blk" and parts[1].isdigit() else -1), name


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
    values = np.ascontiguousarray(values, dtype=np.float32)
    if qtype.name in QUANTIZERS:  # the k-quants, which the gguf package reads but does not write
        return quantize_k(values, qtype.name)
    return gguf.quants.quantize(values, qtype)
