"""``--gguf_type q4_k_m`` (and every other k-quant mix) against llama.cpp's own ``llama-quantize``, byte for byte.

Needs a llama.cpp build (not installed by the project; ``pip download --no-binary :all: llama-cpp-python`` holds
its source under ``vendor/llama.cpp``, built with cmake): ``--llama_cpp DIR`` is its ``build/bin`` folder with
``llama-quantize`` and ``libggml-base.so``.

1. The quantizers alone: random tensors of several kinds through ``pl_lowprec.export.gguf_kquants.quantize_k``
   and through ggml's ``ggml_quantize_chunk`` (ctypes, no importance matrix): how many super-blocks differ.
   The 32-value types the ``gguf`` package writes (Q8_0, and the fallbacks Q4_0, Q5_0, Q5_1) the same way.
2. Whole files: a bf16 model directory (random weights, real shapes shrunk in depth) exported with
   ``--gguf_type bf16`` and requantized by ``llama-quantize ... Q4_K_M``, against the direct ``--gguf_type q4_k_m``
   export: each tensor's type and bytes, and the metadata.

    python benchmarks/gguf_kquants.py --llama_cpp /path/to/llama.cpp/build/bin
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

GGML_TYPES = {"Q2_K": (10, 84), "Q3_K": (11, 110), "Q4_K": (12, 144), "Q5_K": (13, 176), "Q6_K": (14, 210)}


def random_cases(rng: np.random.Generator) -> dict[str, np.ndarray]:
    cases = {
        "normal, std 0.02": rng.standard_normal((512, 2048)) * 0.02,
        "heavy tails (Student t, 2 dof)": rng.standard_t(2, (256, 1024)) * 0.01,
        "one sign": rng.uniform(0, 1, (64, 1024)),
        "sparse (5% nonzero)": rng.standard_normal((64, 1024)) * (rng.uniform(size=(64, 1024)) < 0.05),
        "outliers (0.2% at 5)": rng.standard_normal((64, 1024)) * 0.02 + (rng.uniform(size=(64, 1024)) < 0.002) * 5,
        "ties (multiples of 1/8)": np.round(rng.standard_normal((64, 1024)) * 8) / 8,
        "tiny (1e-12)": rng.standard_normal((32, 1024)) * 1e-12,
        "constant rows": np.repeat(rng.standard_normal((32, 1)), 1024, axis=1),
        "zeros": np.zeros((8, 1024)),
    }
    cases["bf16 weights"] = torch.tensor(rng.standard_normal((256, 1024)) * 0.02).bfloat16().float().numpy()
    return {name: np.ascontiguousarray(x, dtype=np.float32) for name, x in cases.items()}


def against_ggml(library: Path) -> list[tuple[str, str, int, int, float, float]]:
    from pl_lowprec.export.gguf_kquants import quantize_k

    lib = ctypes.CDLL(str(library))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 3
    lib.ggml_quantize_chunk.argtypes += [ctypes.c_void_p]
    rows = []
    for name, x in random_cases(np.random.default_rng(0)).items():
        for kind, (code, block_bytes) in GGML_TYPES.items():
            reference = np.zeros((x.shape[0], x.shape[1] // 256 * block_bytes), dtype=np.uint8)
            lib.ggml_quantize_init(code)
            start = time.perf_counter()
            lib.ggml_quantize_chunk(code, x.ctypes.data, reference.ctypes.data, 0, x.shape[0], x.shape[1], None)
            ggml_s = time.perf_counter() - start
            start = time.perf_counter()
            mine = quantize_k(x, kind)
            ours_s = time.perf_counter() - start
            differ = int((mine.reshape(-1, block_bytes) != reference.reshape(-1, block_bytes)).any(axis=1).sum())
            rows.append((name, kind, differ, x.size // 256, ours_s, ggml_s))
    return rows


def gguf_package_against_ggml(library: Path) -> list[tuple[str, int, int, int]]:
    """The 32-value types the export writes with the ``gguf`` package (Q8_0, and the fallbacks Q4_0, Q5_0, Q5_1)
    against ggml, on the same tensors: (type, blocks, blocks whose bytes differ, blocks whose values differ)."""
    import gguf

    lib = ctypes.CDLL(str(library))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 3
    lib.ggml_quantize_chunk.argtypes += [ctypes.c_void_p]
    rows = []
    for kind, code in (("Q8_0", 8), ("Q4_0", 2), ("Q5_0", 6), ("Q5_1", 7)):
        qtype = getattr(gguf.GGMLQuantizationType, kind)
        block, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
        blocks = differ = values_differ = 0
        for x in random_cases(np.random.default_rng(0)).values():
            reference = np.zeros((x.shape[0], x.shape[1] // block * block_bytes), dtype=np.uint8)
            lib.ggml_quantize_init(code)
            lib.ggml_quantize_chunk(code, x.ctypes.data, reference.ctypes.data, 0, x.shape[0], x.shape[1], None)
            theirs = gguf.quants.quantize(x, qtype)
            same_bytes = (theirs.reshape(-1, block_bytes) == reference.reshape(-1, block_bytes)).all(axis=1)
            read = [gguf.quants.dequantize(q, qtype).reshape(-1, block) for q in (theirs, reference)]
            blocks += same_bytes.size
            differ += int((~same_bytes).sum())
            values_differ += int((read[0] != read[1]).any(axis=1).sum())
        rows.append((kind, blocks, differ, values_differ))
    return rows


def tensors(path: Path) -> dict[str, tuple[str, bytes]]:
    import gguf

    reader = gguf.GGUFReader(path)
    return {t.name: (t.tensor_type.name, bytes(np.asarray(t.data).tobytes())) for t in reader.tensors}


def against_llama_quantize(binaries: Path, root: Path) -> list[tuple]:
    from gguf_helpers import shrunk_model
    from loading_helpers import save_tokenizer
    from model_shapes import LLAMA31_8B, QWEN25_05B, SMOLLM2_135M

    from pl_lowprec.export.gguf_convert import convert_to_gguf
    from pl_lowprec.export.gguf_types import LLAMA_QUANTIZE

    tokenizer = save_tokenizer(root / "tokenizer")
    rows = []
    models = [  # name, real config, head_dim, layers
        ("Llama-3.1-8B", LLAMA31_8B, 8, 16),  # GQA 32/8, untied output; hidden 256; 16 layers for use_more_bits
        ("SmolLM2-135M", SMOLLM2_135M, 64, 4),  # 9/3 heads, tied; hidden 576: rows that do not split into 256
        ("Qwen2.5-0.5B", QWEN25_05B, 64, 4),  # 14/2 heads, qkv biases, tied; hidden 896
    ]
    shapes = ROOT.parent / "shared" / "model-shapes"
    if (shapes / "llama-3.2-1b.json").is_file():  # tied with rows of 256: the embedding is the output, at Q6_K
        models.append(("Llama-3.2-1B", json.loads((shapes / "llama-3.2-1b.json").read_text()), 8, 16))
    if (shapes / "llama-3.1-70b.json").is_file():  # 80 layers, grouped KV heads: LLM_TYPE_70B, attn_v at Q5_K
        models.append(("Llama-3.1-70B", json.loads((shapes / "llama-3.1-70b.json").read_text()), 4, 80))
    for name, shape, head_dim, layers in models:
        fields = {k: v for k, v in shape.items() if k not in ("architectures", "torch_dtype")}
        # 352 embedding rows: the demo tokenizer's 320 padded as Qwen pads
        directory = shrunk_model(root / name, tokenizer, fields, head_dim, 352, layers, bos_token_id=0, eos_token_id=1)
        bf16 = root / f"{directory.name}-bf16.gguf"
        convert_to_gguf(directory, bf16, "bf16", directory.name)
        for gguf_type in LLAMA_QUANTIZE:
            ftype = gguf_type.upper()  # llama-quantize's name of the mix
            ours = root / f"{directory.name}-{gguf_type}.gguf"
            start = time.perf_counter()
            convert_to_gguf(directory, ours, gguf_type, directory.name)
            ours_s = time.perf_counter() - start
            theirs = root / f"{directory.name}-{gguf_type}-llama.gguf"
            done = subprocess.run(
                [str(binaries / "llama-quantize"), str(bf16), str(theirs), ftype, "1"], capture_output=True, text=True
            )
            if done.returncode:
                raise RuntimeError(done.stderr[-3000:])
            mine, reference = tensors(ours), tensors(theirs)
            same_types = sum(mine[n][0] == reference[n][0] for n in reference)
            same_bytes = sum(mine[n] == reference[n] for n in reference)
            kinds = sorted({kind for kind, _ in reference.values()})
            rows.append((name, layers, gguf_type, len(reference), same_types, same_bytes, kinds, ours_s))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama_cpp", type=Path, required=True, help="llama.cpp's build/bin folder")
    args = parser.parse_args()
    print("| tensor values | type | super-blocks differing from ggml | super-blocks | ours s | ggml s |")
    print("|---|---|---|---|---|---|")
    for name, kind, differ, blocks, ours_s, ggml_s in against_ggml(args.llama_cpp / "libggml-base.so"):
        print(f"| {name} | {kind} | {differ} | {blocks} | {ours_s:.3f} | {ggml_s:.3f} |")
    print()
    print("| type (the gguf package's quantizer) | blocks | bytes differing from ggml | values read back differing |")
    print("|---|---|---|---|")
    for kind, blocks, differ, values_differ in gguf_package_against_ggml(args.llama_cpp / "libggml-base.so"):
        print(f"| {kind} | {blocks} | {differ} | {values_differ} |")
    print()
    header = "| model shape | layers | --gguf_type | tensors | same type as llama-quantize | same bytes | types |"
    print(f"{header} export s |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as root:
        for shape, layers, gguf_type, count, same_types, same_bytes, kinds, ours_s in against_llama_quantize(
            args.llama_cpp, Path(root)
        ):
            row = f"| {shape} | {layers} | {gguf_type} | {count} | {same_types} | {same_bytes}"
            print(f"{row} | {', '.join(kinds)} | {ours_s:.1f} |")


if __name__ == "__main__":
    main()
