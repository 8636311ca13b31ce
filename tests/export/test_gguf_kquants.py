"""``--gguf_type q4_k_m`` and the other k-quant mixes (q6_k to q2_k) as llama-quantize writes them, without llama.cpp.

The reference is llama.cpp itself, which CI does not have: the digests below are of ggml's own bytes
(``ggml_quantize_chunk``, no importance matrix) for ``kquant_values.fixed_values()``, recorded from llama.cpp
0c1e570 (the vendored source of llama-cpp-python 0.3.36, built here); the per-tensor types are the ones its
``llama-quantize`` wrote for the same shapes. ``benchmarks/gguf_kquants.py`` repeats both against a build.
"""

from __future__ import annotations

import hashlib
from itertools import pairwise

import numpy as np
import pytest
import torch
from gguf_helpers import convert, held_out_ids, logits, metadata
from gguf_helpers import shrunk_model as shrunk
from kquant_values import fixed_values
from loading_helpers import save_tokenizer
from model_shapes import LLAMA31_8B, QWEN25_05B, SMOLLM2_135M

gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")

from pl_lowprec.export.gguf_kquants import quantize_k  # noqa: E402
from pl_lowprec.export.gguf_types import MixModel, k_mix_types  # noqa: E402

GGML_DIGESTS = {
    "Q2_K": "a0b92d445e5cf1325801405fad4bec11c43e0acc34bcb570f07376147760c7ca",
    "Q3_K": "fcb431d5b93616dfa70183f7131f03f863fe9cf2a576733f51e46726ed29bf3e",
    "Q4_K": "5d2033e62a419e1bb22eab7ab8345356b91467acbe1676581c667826dd5f8d1c",
    "Q5_K": "39433354f91141c91fbe93c62903ea1b1aeff9d72416baab1f8afba15c31acbb",
    "Q6_K": "643b2d6bfc034e1fe667595f6205f09722d77fd7842f7bfc1c557c8529552a52",
}


@pytest.mark.parametrize("kind", list(GGML_DIGESTS))
def test_k_quant_bytes_are_ggmls(kind):
    values = fixed_values()
    assert hashlib.sha256(values.tobytes()).hexdigest()[:16] == "1d6f1e6a40384343"  # the inputs ggml quantized
    assert hashlib.sha256(quantize_k(values, kind).tobytes()).hexdigest() == GGML_DIGESTS[kind]


# The largest error in a 256-value super-block, of its largest magnitude, at 1.5x the measured (Q2_K 0.53, Q3_K
# 0.24, Q4_K 0.114, Q5_K 0.050, Q6_K 0.018: 4 to 64 levels over sub-blocks of 16 or 32, each with its own scale).
WORST_ERROR = {"Q2_K": 0.8, "Q3_K": 0.36, "Q4_K": 0.17, "Q5_K": 0.075, "Q6_K": 0.027}


@pytest.mark.parametrize("kind", list(GGML_DIGESTS))
def test_k_quant_blocks_read_back_within_their_levels(kind):
    """The gguf package's own dequantizer reads the blocks back. Constant rows to 1e-3, zero rows exactly; values
    of 1e-13 (rows 176-183) read back as zeros, as ggml writes them: their scale is below float16's smallest."""
    values = fixed_values()
    back = gguf.quants.dequantize(quantize_k(values, kind), getattr(gguf.GGMLQuantizationType, kind))
    assert back.shape == values.shape
    blocks, read = values[:176].reshape(-1, 256), back[:176].reshape(-1, 256)
    worst = (np.abs(read - blocks).max(axis=1) / np.abs(blocks).max(axis=1)).max()
    assert worst <= WORST_ERROR[kind], worst
    assert not back[176:184].any() and np.abs(values[176:184]).max() < 1e-12
    np.testing.assert_allclose(back[184:188], values[184:188], rtol=1e-3)
    assert np.array_equal(back[188:], values[188:])


def test_rows_that_do_not_split_into_super_blocks_are_refused():
    with pytest.raises(ValueError, match="Q4_K needs rows of a multiple of 256 values, not 576"):
        quantize_k(np.zeros((2, 576), dtype=np.float32), "Q4_K")


def llama_tensors(layers: int, hidden: int, tied: bool) -> list[tuple[str, tuple[int, ...]]]:
    """The GGUF tensors of a Llama in the order this export writes them (safetensors' sorted keys: blk.10 before
    blk.2), which is not the order llama-quantize counts layers in."""
    names = [] if tied else [("output.weight", (352, hidden))]
    names.append(("token_embd.weight", (352, hidden)))
    for layer in sorted(range(layers), key=str):
        for kind, shape in (
            ("attn_norm", (hidden,)),
            ("ffn_down", (hidden, 2 * hidden)),
            ("ffn_gate", (2 * hidden, hidden)),
            ("ffn_up", (2 * hidden, hidden)),
            ("ffn_norm", (hidden,)),
            ("attn_k", (hidden // 4, hidden)),
            ("attn_output", (hidden, hidden)),
            ("attn_q", (hidden, hidden)),
            ("attn_v", (hidden // 4, hidden)),
        ):
            names.append((f"blk.{layer}.{kind}.weight", shape))
    return [("output_norm.weight", (hidden,)), *names]


def types_by_name(gguf_type, tensors, layers, gqa=4, seventy_b=False) -> dict[str, str]:
    types = k_mix_types(gguf, gguf_type, tensors, MixModel(layers, gqa, seventy_b))
    return {name: kind.name for (name, _), kind in zip(tensors, types, strict=True)}


# As llama-quantize 0c1e570 chose them for Llama-3.1-8B's shapes cut to 16 layers (GQA 32/8, untied output;
# benchmarks/gguf_kquants.py: every tensor the same type and bytes): per layer 0-15, the digit d of Q{d}_K.
MIX_16 = {  # mix: attn_v, ffn_down, attn_output, every other block matrix and the embedding
    "q6_k": ("6" * 16, "6" * 16, "6" * 16, "6"),
    "q5_k_m": ("6655655655655666", "6655655655655666", "5" * 16, "5"),  # use_more_bits: 0, 1, 4, 7, 10, 13-15
    "q5_k_s": ("5" * 16, "5" * 16, "5" * 16, "5"),
    "q4_k_m": ("6644644644644666", "6644644644644666", "4" * 16, "4"),
    "q4_k_s": ("5555" + "4" * 12, "55" + "4" * 14, "4" * 16, "4"),  # attn_v 0-3, ffn_down the first eighth
    "q3_k_l": ("5" * 16, "5" * 16, "5" * 16, "3"),
    "q3_k_m": ("55" + "4" * 14, "5" + "4" * 15, "4" * 16, "3"),  # attn_v 0-1, ffn_down the first sixteenth
    "q3_k_s": ("3" * 16, "3" * 16, "3" * 16, "3"),
    "q2_k": ("4" * 16, "3" * 16, "3" * 16, "2"),  # attn_v at Q4_K with 4 query heads per KV head or more
}


@pytest.mark.parametrize("gguf_type", list(MIX_16))
def test_each_mix_gives_each_layer_the_types_llama_quantize_gives_it(gguf_type):
    values, down, output, other = MIX_16[gguf_type]
    types = types_by_name(gguf_type, llama_tensors(16, 256, tied=False), 16)
    for layer in range(16):
        for kind, digits in (("attn_v", values), ("ffn_down", down), ("attn_output", output)):
            assert types[f"blk.{layer}.{kind}.weight"] == f"Q{digits[layer]}_K", (layer, kind)
        for kind in ("attn_q", "attn_k", "ffn_gate", "ffn_up"):
            assert types[f"blk.{layer}.{kind}.weight"] == f"Q{other}_K", (layer, kind)
        assert types[f"blk.{layer}.attn_norm.weight"] == "F32"
    assert types["output.weight"] == "Q6_K" and types["token_embd.weight"] == f"Q{other}_K"
    tied = types_by_name(gguf_type, llama_tensors(16, 256, tied=True), 16)  # Llama-3.2-1B: the embedding is the output
    assert tied["token_embd.weight"] == "Q6_K" and "output.weight" not in tied


def test_q4_0_is_llama_quantizes_every_matrix_q4_0_but_the_output_at_q6_k():
    types = types_by_name("q4_0", llama_tensors(16, 256, tied=False), 16)
    assert types.pop("output.weight") == "Q6_K"
    assert {kind for name, kind in types.items() if not name.endswith("norm.weight")} == {"Q4_0"}
    tied = types_by_name("q4_0", llama_tensors(2, 256, tied=True), 2)
    assert tied["token_embd.weight"] == "Q6_K"
    narrow = types_by_name("q4_0", llama_tensors(2, 224, tied=True), 2)  # Qwen2.5's shapes: rows of 224
    assert narrow["token_embd.weight"] == "Q8_0" and narrow["blk.0.attn_q.weight"] == "Q4_0"


def test_q2_k_keeps_attn_v_at_q3_k_with_fewer_than_4_query_heads_per_kv_head():
    """SmolLM2's 9/3 heads: n_gqa 3."""
    types = types_by_name("q2_k", llama_tensors(4, 256, tied=True), 4, gqa=3)
    assert {types[f"blk.{i}.attn_v.weight"] for i in range(4)} == {"Q3_K"}
    assert types_by_name("q2_k", llama_tensors(4, 256, tied=True), 4, gqa=4)["blk.0.attn_v.weight"] == "Q4_K"


def test_the_mix_reads_layers_query_heads_per_kv_head_and_70b_from_the_config():
    from types import SimpleNamespace

    from pl_lowprec.export.gguf_arch import ARCHITECTURES
    from pl_lowprec.export.gguf_convert import mix_model

    def read(config, **changes):
        return mix_model(SimpleNamespace(**{**config, **changes}), ARCHITECTURES[config["model_type"]])

    assert read(LLAMA31_8B) == MixModel(32, 4, False)
    assert read(SMOLLM2_135M) == MixModel(30, 3, False)
    assert read(QWEN25_05B) == MixModel(24, 7, False)
    assert read(LLAMA31_8B, num_hidden_layers=80, num_attention_heads=64) == MixModel(80, 8, True)  # 70B's
    assert read(LLAMA31_8B, num_hidden_layers=80, num_key_value_heads=32) == MixModel(80, 1, False)  # LLaMA 65B
    assert read(QWEN25_05B, num_hidden_layers=80) == MixModel(80, 7, True)  # Qwen2 is 70B at 80 layers


def test_mix_of_a_70b_raises_attn_v_from_q3_k_or_q4_k_to_q5_k_and_q6_k_stays_q6_k():
    tensors = llama_tensors(80, 256, tied=False)
    q4 = types_by_name("q4_k_m", tensors, 80, seventy_b=True)
    assert {q4[f"blk.{i}.attn_v.weight"] for i in range(80)} == {"Q5_K", "Q6_K"}
    assert q4["blk.20.attn_v.weight"] == "Q5_K" and q4["blk.20.ffn_down.weight"] == "Q4_K"
    q6 = types_by_name("q6_k", tensors, 80, seventy_b=True)
    assert {kind for name, kind in q6.items() if not name.endswith("norm.weight")} == {"Q6_K"}
    for gguf_type in ("q3_k_s", "q3_k_m", "q2_k"):  # Q3_K and Q4_K become Q5_K
        types = types_by_name(gguf_type, tensors, 80, seventy_b=True)
        assert {types[f"blk.{i}.attn_v.weight"] for i in range(80)} == {"Q5_K"}, gguf_type


def test_mix_falls_back_where_rows_do_not_split_into_256_values():
    """SmolLM2's hidden 576: Q4_K becomes Q5_0, Q6_K Q8_0, Q3_K Q4_0, the tied embedding (the output matrix) Q8_0;
    a row of 100 values splits into neither, and is F16."""
    tensors = llama_tensors(4, 576, tied=True)
    types = types_by_name("q4_k_m", tensors, 4)
    assert types["token_embd.weight"] == "Q8_0"
    assert types["blk.0.attn_q.weight"] == "Q5_0" and types["blk.3.ffn_down.weight"] == "Q8_0"  # more bits
    assert types["blk.1.ffn_down.weight"] == "Q5_0"  # use_more_bits(1, 4) is false; (2, 4) and (3, 4) true
    assert types_by_name("q5_k_m", tensors, 4)["blk.1.ffn_down.weight"] == "Q5_1"
    q3 = types_by_name("q3_k_m", tensors, 4)  # Q3_K and Q2_K fall back to Q4_0, Q5_K to Q5_1
    assert q3["blk.1.attn_q.weight"] == "Q4_0" and q3["blk.0.attn_v.weight"] == "Q5_1"
    odd = types_by_name("q4_k_m", [("blk.0.attn_q.weight", (8, 100))], 1)
    assert odd == {"blk.0.attn_q.weight": "F16"}


@pytest.mark.parametrize("name", ["llama3.1", "qwen2.5"])
def test_each_mix_reads_back_closer_than_the_next_smaller_one(tmp_path, name):
    """Through the export's converter: Llama-3.1-8B's shapes (hidden 256: k-quant blocks, an untied output at
    Q6_K) and Qwen2.5's (hidden 224: the 32-value fallbacks, biases, tied). transformers reads each file back;
    the logits' RMS error, of the model's, falls with each step up in size: q4_0 > q4_k_m > q5_k_m > q6_k > q8_0
    (measured: 0.21, 0.16, 0.086, 0.043, 0.014 for Llama's shapes; Qwen's q6_k equals its q8_0, every matrix
    falling back to Q8_0). The header says Q4_K_M."""
    from transformers import AutoConfig, AutoModelForCausalLM

    shapes = {"llama3.1": (LLAMA31_8B, 8, 320), "qwen2.5": (QWEN25_05B, 16, 352)}
    tokenizer = save_tokenizer(tmp_path / "tokenizer")
    model_dir = shrunk(tmp_path / name, tokenizer, *shapes[name], bos_token_id=0, eos_token_id=1)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    extra = {"config": AutoConfig.from_pretrained(model_dir)} if name == "llama3.1" else {}
    ids = held_out_ids()
    expected = logits(reference, ids)
    errors, written = {}, {}
    for gguf_type in ("q4_0", "q4_k_m", "q5_k_m", "q6_k", "q8_0"):
        written[gguf_type] = convert(model_dir, gguf_type)
        read = AutoModelForCausalLM.from_pretrained(
            model_dir.with_name(f"{name}-gguf"), gguf_file=f"model-{gguf_type}.gguf", dtype=torch.float32, **extra
        )
        errors[gguf_type] = float((logits(read, ids) - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt())
    sizes = list(errors.values())
    if name == "qwen2.5":
        assert errors.pop("q6_k") == errors["q8_0"]
        sizes = list(errors.values())
    assert sizes == sorted(sizes, reverse=True) and len(set(sizes)) == len(sizes), errors
    assert (
        dict(written["q4_k_m"]["types"])
        == {
            "llama3.1": {"F32": 6, "Q4_K": 13, "Q6_K": 3},  # output, layer 1's attn_v and ffn_down; rope_freqs F32
            "qwen2.5": {"F32": 11, "Q5_0": 12, "Q8_0": 3},  # the tied embedding, layer 1's attn_v and ffn_down
        }[name]
    )
    fields, _ = metadata(model_dir.with_name(f"{name}-gguf") / "model-q4_k_m.gguf")
    assert fields["general.file_type"] == int(gguf.LlamaFileType.MOSTLY_Q4_K_M)


def test_every_mix_of_fewer_bits_reads_back_further_from_the_model(tmp_path):
    """All nine mixes on Llama-3.1-8B's shapes (hidden 256, 2 layers) read back by transformers: each family of
    fewer bits is further from the model than every mix of the next (q2_k > q3_k_* > q4_k_* > q5_k_* > q6_k >
    q8_0), and within Q3_K the larger mixes are closer (s > m > l). Measured: q2_k 0.44; q3_k_s 0.35, _m 0.23,
    _l 0.22; q4_k_s 0.15, _m 0.16 (with 2 layers, Q4_K_S's Q5_K attn_v in both outweighs Q4_K_M's Q6_K in one);
    q5_k_s 0.091, _m 0.086; q6_k 0.043; q8_0 0.014."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = save_tokenizer(tmp_path / "tokenizer")
    model_dir = shrunk(tmp_path / "llama3.1", tokenizer, LLAMA31_8B, 8, 320, bos_token_id=0, eos_token_id=1)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = held_out_ids()
    expected = logits(reference, ids)
    errors = {}
    for gguf_type in (*MIX_16, "q8_0"):
        convert(model_dir, gguf_type)
        read = AutoModelForCausalLM.from_pretrained(
            model_dir.with_name("llama3.1-gguf"),
            gguf_file=f"model-{gguf_type}.gguf",
            dtype=torch.float32,
            config=AutoConfig.from_pretrained(model_dir),
        )
        errors[gguf_type] = float((logits(read, ids) - expected).pow(2).mean().sqrt() / expected.pow(2).mean().sqrt())
    families = [[errors[t] for t in errors if t.startswith(f"q{bits}_")] for bits in (2, 3, 4, 5, 6, 8)]
    assert all(min(fewer) > max(more) for fewer, more in pairwise(families)), errors
    assert errors["q3_k_s"] > errors["q3_k_m"] > errors["q3_k_l"], errors


def test_a_terminal_sees_the_bytes_written_and_the_tensor_being_quantized(tmp_path, capsys, monkeypatch):
    """An 8B k-quant export runs for minutes: on a terminal, a bar of the file's bytes names each tensor and its
    type as it is quantized, and reaches the file's tensor bytes; off a terminal (CI logs, pipes) nothing."""
    import sys

    tokenizer = save_tokenizer(tmp_path / "tokenizer")
    model_dir = shrunk(tmp_path / "llama", tokenizer, LLAMA31_8B, 8, 320, bos_token_id=0, eos_token_id=1)
    capsys.readouterr()  # save_pretrained's own bar
    convert(model_dir, "q4_k_m")
    assert "model-q4_k_m.gguf" not in capsys.readouterr().err
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    convert(model_dir, "q4_k_m")
    bar = capsys.readouterr().err.replace("\r", "\n")
    assert "Writing model-q4_k_m.gguf" in bar and "blk.1.ffn_down.weight Q6_K" in bar, bar
    from tqdm import tqdm

    written = gguf.GGUFReader(model_dir.with_name("llama-gguf") / "model-q4_k_m.gguf").tensors
    total = tqdm.format_sizeof(sum(int(tensor.n_bytes) for tensor in written))  # the tensors' bytes, as "783k"
    assert f"/{total} [" in bar and f"{written[-1].name} {written[-1].tensor_type.name}" in bar, bar
