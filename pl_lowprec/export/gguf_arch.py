"""A Hugging Face decoder's config and tensors as llama.cpp's converter (``convert_hf_to_gguf.py``) writes them.

One row per architecture the package fine-tunes: Llama and Mistral become llama.cpp's ``llama`` (its
``LlamaModel``, which also converts ``MistralForCausalLM``), Qwen2 its ``qwen2``. Tensor names come from the
``gguf`` package's own ``TensorNameMap``; the hyperparameter keys are those of ``TextModel.set_gguf_parameters``.
llama.cpp computes rotary embeddings on interleaved pairs for ``llama`` (Hugging Face rotates halves), so Q and K
rows are permuted as ``LlamaModel.permute`` does; ``qwen2`` runs the half-rotation (NeoX) kernel and is not
permuted. Llama 3's ``rope_type: llama3`` frequencies go in a ``rope_freqs`` tensor, as ``generate_extra_tensors``
writes it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

ROPE_TYPES = ("default", "llama3", "linear", "yarn")
# Buffers a checkpoint may hold that llama.cpp recomputes (convert_hf_to_gguf skips the same suffixes).
SKIPPED_SUFFIXES = (".rotary_emb.inv_freq", ".attention.masked_bias", ".attention.bias")


@dataclass(frozen=True)
class Architecture:
    """How one Hugging Face ``model_type`` is written: llama.cpp's architecture and whether Q/K are permuted."""

    model_type: str
    gguf_arch: str  # a gguf.MODEL_ARCH member name
    permute_qk: bool


ARCHITECTURES = {
    "llama": Architecture("llama", "LLAMA", permute_qk=True),
    "mistral": Architecture("mistral", "LLAMA", permute_qk=True),
    "qwen2": Architecture("qwen2", "QWEN2", permute_qk=False),
}


def architecture(config: Any) -> Architecture:
    """The row for ``config``; a ``ValueError`` naming what is supported otherwise (checked before any work)."""
    model_type = getattr(config, "model_type", None)
    arch = ARCHITECTURES.get(model_type)
    if arch is None:
        raise ValueError(
            f"--format gguf writes the architectures llama.cpp and this package share ({', '.join(ARCHITECTURES)}),"
            f" and this model's config.json says model_type={model_type!r}. Export --format merged and convert it"
            " with llama.cpp's convert_hf_to_gguf.py, which knows more architectures."
        )
    activation = getattr(config, "hidden_act", "silu")
    if activation != "silu":
        raise ValueError(
            f"llama.cpp's {arch.gguf_arch.lower()} computes the MLP with SiLU, and this {model_type} config has"
            f" hidden_act={activation!r}: the GGUF would compute something else. Export --format merged instead."
        )
    rope_type = rope_parameters(config).get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"This {model_type} config has rope_type={rope_type!r}; --format gguf writes {', '.join(ROPE_TYPES)}"
            " (what llama.cpp's converter writes for these architectures). Export --format merged instead."
        )
    return arch


def rope_parameters(config: Any) -> dict[str, Any]:
    """transformers 5's ``rope_parameters`` (``rope_theta`` and any scaling), or the older two attributes."""
    params = getattr(config, "rope_parameters", None)
    if params:
        return dict(params)
    params = dict(getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_type", params.pop("type", "default"))
    params.setdefault("rope_theta", getattr(config, "rope_theta", 10000.0))
    return params


def head_dim(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def add_hyperparameters(writer: Any, gguf: Any, config: Any, arch: Architecture, file_type: int) -> None:
    """The ``{arch}.*`` keys llama.cpp reads (``TextModel`` + ``LlamaModel.set_gguf_parameters``)."""
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    rope = rope_parameters(config)
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    elif rope.get("rope_type") == "yarn":
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for key, add in (
            ("extrapolation_factor", writer.add_rope_scaling_yarn_ext_factor),
            ("attention_factor", writer.add_rope_scaling_yarn_attn_factor),
            ("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
            ("beta_slow", writer.add_rope_scaling_yarn_beta_slow),
        ):
            if rope.get(key) is not None:
                add(rope[key])
    writer.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    if getattr(config, "head_dim", None) is not None:
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    writer.add_file_type(file_type)
    if arch.gguf_arch == "LLAMA":
        writer.add_vocab_size(config.vocab_size)
        writer.add_rope_dimension_count(head_dim(config))


def llama3_rope_factors(config: Any) -> np.ndarray | None:
    """The per-frequency divisors of ``rope_type: llama3`` (``rope_freqs.weight``), as llama.cpp computes them."""
    rope = rope_parameters(config)
    if rope.get("rope_type") != "llama3":
        return None
    dim = head_dim(config)
    freqs = 1.0 / (rope.get("rope_theta", 10000.0) ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context = rope.get("original_max_position_embeddings", 8192)
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            factors.append(1.0)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def permute_qk(name: str, tensor: np.ndarray, config: Any, arch: Architecture) -> np.ndarray:
    """Q and K rows (weights and biases) reordered from half rotation to llama.cpp's interleaved pairs."""
    if not arch.permute_qk or not name.endswith(("q_proj.weight", "q_proj.bias", "k_proj.weight", "k_proj.bias")):
        return tensor
    heads = config.num_attention_heads
    if ".k_proj." in name:
        heads = getattr(config, "num_key_value_heads", None) or heads
    shape = tensor.shape
    return tensor.reshape(heads, 2, shape[0] // heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
