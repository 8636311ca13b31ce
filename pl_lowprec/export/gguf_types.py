"""``--gguf_type``: the GGML type each tensor is written in, chosen as llama.cpp chooses it.

``convert_hf_to_gguf.prepare_tensors`` writes 1-D tensors and norms in F32 and every other weight in the file's
type, falling back to F16 where a row does not divide into the type's blocks (32 values for Q8_0 and Q4_0).

The ``_k`` types (``q6_k`` down to ``q2_k``) are ``llama-quantize``'s mixes, chosen per tensor as its
``llama_tensor_get_type`` chooses them for these architectures (``src/llama-quant.cpp``), in the order its model
loader keeps the tensors (``weight_name_comparer``: the others, then each block's, by layer and name): the
output matrix (the embedding where they are tied) Q6_K, or Q8_0 where its rows do not split into 256-value
super-blocks; ``attn_v``, ``ffn_down`` and ``attn_output`` with more bits in the layers and mixes it picks
(Q4_K_M and Q5_K_M: Q6_K where ``use_more_bits``, the first and last eighth and every third between; the
``_s``, ``_l`` and Q2_K mixes by their own rules; a 70B's ``attn_v`` at Q5_K); and where a row does not split
into 256 values, the type's 32-value fallback (``FALLBACK``), else F16. The k-quant blocks are written by
``gguf_kquants`` as ggml writes them.

``q4_0`` is not one of the converter's types either: it is ``llama-quantize``'s too, every matrix Q4_0 but the
output matrix, at Q6_K (Q8_0 where its rows do not split into 256 values), as the mixes keep it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pl_lowprec.export.gguf_kquants import QUANTIZERS, quantize_k

# --gguf_type -> (the GGMLQuantizationType of matrices, the LlamaFileType of general.file_type), largest first
GGUF_TYPES = {
    "bf16": ("BF16", "MOSTLY_BF16"),
    "f16": ("F16", "MOSTLY_F16"),
    "q8_0": ("Q8_0", "MOSTLY_Q8_0"),
    "q6_k": ("Q6_K", "MOSTLY_Q6_K"),
    "q5_k_m": ("Q5_K", "MOSTLY_Q5_K_M"),
    "q5_k_s": ("Q5_K", "MOSTLY_Q5_K_S"),
    "q4_k_m": ("Q4_K", "MOSTLY_Q4_K_M"),
    "q4_0": ("Q4_0", "MOSTLY_Q4_0"),
    "q4_k_s": ("Q4_K", "MOSTLY_Q4_K_S"),
    "q3_k_l": ("Q3_K", "MOSTLY_Q3_K_L"),
    "q3_k_m": ("Q3_K", "MOSTLY_Q3_K_M"),
    "q3_k_s": ("Q3_K", "MOSTLY_Q3_K_S"),
    "q2_k": ("Q2_K", "MOSTLY_Q2_K"),
}
K_MIXES = tuple(name for name, (kind, _) in GGUF_TYPES.items() if kind.endswith("_K"))
LLAMA_QUANTIZE = (*K_MIXES, "q4_0")  # the types llama-quantize makes, tensor by tensor (its converter does not)
MORE_BITS = ("q4_k_m", "q5_k_m")  # attn_v and ffn_down at Q6_K in the layers use_more_bits picks
ATTN_OUTPUT = {"q2_k": "Q3_K", "q3_k_m": "Q4_K", "q3_k_l": "Q5_K"}  # the others keep the mix's type
# llama.cpp's tensor_type_fallback, for rows that do not split into 256-value super-blocks (then F16)
FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


@dataclass(frozen=True)
class MixModel:
    """What ``llama-quantize``'s choice of types reads from the model besides each tensor's name and shape."""

    layers: int
    gqa: int = 1  # query heads per KV head (its n_gqa): Q2_K keeps attn_v at Q4_K from 4 up
    seventy_b: bool = False  # its LLM_TYPE_70B: attn_v with more bits


# llama-quantize's other types: why this export does not write them, and what to run instead
NEEDS_IMATRIX = ("iq1_s", "iq1_m", "iq2_xxs", "iq2_xs", "iq2_s", "iq2_m", "iq3_xxs", "iq3_xs", "iq3_s", "iq3_m")
NEEDS_IMATRIX += ("iq4_nl", "iq4_xs", "q2_k_s")
LEGACY = ("q4_1", "q5_0", "q5_1")


def check_gguf_type(gguf_type: str) -> None:
    if gguf_type in GGUF_TYPES:
        return
    instead = "choose one of those, or export --gguf_type bf16 and run llama.cpp's llama-quantize on the file"
    if gguf_type.lower() in GGUF_TYPES:
        lower = gguf_type.lower()
        raise ValueError(f"--gguf_type is written in lower case, as in the file's name: --gguf_type {lower}.")
    if gguf_type.lower() in NEEDS_IMATRIX:
        why = (
            f"{gguf_type} is one of llama.cpp's importance-matrix types (llama-quantize --imatrix), and this export"
            " computes no importance matrix"
        )
        instead = (
            "export --gguf_type bf16, compute the matrix with llama.cpp's llama-imatrix on text like your data, and"
            " run llama-quantize --imatrix on the file; or choose q2_k or q3_k_s, which need none"
        )
    elif gguf_type.lower() in LEGACY:
        why = f"{gguf_type} is one of llama.cpp's legacy types, kept for old files; the k-quant mixes replace them"
    else:
        why = f"--gguf_type {gguf_type!r} is not one this export writes"
    raise ValueError(
        f"{why}. It writes auto (the default: the merged weights' 16-bit type), {', '.join(GGUF_TYPES)} (bf16 keeps"
        " a bf16 model exactly; q8_0 is about half its size;"
        f" q4_k_m, Ollama's default, about 30%; each k-quant mix as llama-quantize writes it): {instead}."
    )


def file_type(gguf: Any, gguf_type: str) -> int:
    return int(getattr(gguf.LlamaFileType, GGUF_TYPES[gguf_type][1]))


def _is_matrix(name: str, shape: tuple[int, ...]) -> bool:
    return len(shape) >= 2 and name.endswith(".weight") and not name.endswith("_norm.weight")


def tensor_types(
    gguf: Any, gguf_type: str, tensors: Sequence[tuple[str, tuple[int, ...]]], model: MixModel
) -> list[Any]:
    """The GGML type of each of ``tensors`` (GGUF name and shape): as ``llama-quantize`` chooses it for its
    types, or one type for every matrix, as llama.cpp's converter writes it."""
    if gguf_type in LLAMA_QUANTIZE:
        return k_mix_types(gguf, gguf_type, tensors, model)
    return [single_type(gguf, gguf_type, name, shape) for name, shape in tensors]


def _is_output(name: str, tied: bool) -> bool:
    """The matrix that makes the logits: ``output.weight``, or the embedding where the file has none."""
    return name == "output.weight" or (tied and name == "token_embd.weight")


def single_type(gguf: Any, gguf_type: str, name: str, shape: tuple[int, ...]) -> Any:
    """The GGML type of one tensor of a converter's single-type file (``name`` is its GGUF name)."""
    kinds = gguf.GGMLQuantizationType
    if not _is_matrix(name, shape):
        return kinds.F32
    wanted = getattr(kinds, GGUF_TYPES[gguf_type][0])
    block = gguf.GGML_QUANT_SIZES[wanted][0]
    return wanted if shape[-1] % block == 0 else kinds.F16


def use_more_bits(layer: int, layers: int) -> bool:
    """llama.cpp's choice of the layers that get more bits: the first and last eighth, and every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def k_mix_types(
    gguf: Any, gguf_type: str, tensors: Sequence[tuple[str, tuple[int, ...]]], model: MixModel
) -> list[Any]:
    """The type of each of ``tensors`` (GGUF name and shape) in ``llama-quantize``'s mix (or its ``q4_0``)."""
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
            wanted = _attn_v_type(gguf_type, value_index, values_heads, model)
            value_index += 1
        elif "ffn_down" in name:
            wanted = _ffn_down_type(gguf_type, down_index, model.layers)
            down_index += 1
        elif "attn_output" in name:
            wanted = ATTN_OUTPUT.get(gguf_type, default)
        for candidate in (wanted, FALLBACK.get(wanted, wanted), "F16"):
            if shape[-1] % gguf.GGML_QUANT_SIZES[getattr(kinds, candidate)][0] == 0:
                break
        chosen[position] = getattr(kinds, candidate)
    return chosen


def _attn_v_type(mix: str, index: int, count: int, model: MixModel) -> str:
    """``attn_v`` number ``index`` of ``count``, as ``llama_tensor_get_type_impl`` chooses it."""
    if mix == "q2_k":
        wanted = "Q4_K" if model.gqa >= 4 else "Q3_K"
    elif mix == "q3_k_m":
        wanted = "Q5_K" if index < 2 else "Q4_K"
    elif mix == "q3_k_l":
        wanted = "Q5_K"
    elif mix in MORE_BITS and use_more_bits(index, count):
        wanted = "Q6_K"
    elif mix == "q4_k_s" and index < 4:
        wanted = "Q5_K"
    else:
        wanted = GGUF_TYPES[mix][0]
    if model.seventy_b and wanted in ("Q3_K", "Q4_K"):  # a 70B's attn_v is 8x smaller than its attn_q
        wanted = "Q5_K"
    return wanted


def _ffn_down_type(mix: str, layer: int, layers: int) -> str:
    """``ffn_down`` of ``layer`` (of ``layers``), as ``llama_tensor_get_type_impl`` chooses it."""
    if mix == "q2_k":
        return "Q3_K"
    if mix == "q3_k_m":
        return "Q5_K" if layer < layers // 16 else "Q4_K"
    if mix == "q3_k_l":
        return "Q5_K"
    if mix in MORE_BITS and use_more_bits(layer, layers):
        return "Q6_K"
    if mix == "q4_k_s" and layer < layers // 8:
        return "Q5_K"
    return GGUF_TYPES[mix][0]


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
