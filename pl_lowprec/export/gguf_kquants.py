"""llama.cpp's k-quants Q4_K, Q5_K and Q6_K, written as ``llama-quantize`` writes them without an importance matrix.

The ``gguf`` package reads these types but cannot write them (its ``quantize`` raises for them), and Q4_K_M,
Ollama's default, is made of them. This is a numpy port of ggml's reference quantizers (``ggml-quants.c``:
``quantize_row_q4_K_ref``, ``quantize_row_q5_K_ref``, ``quantize_row_q6_K_ref`` and their ``make_qkx2_quants``
and ``make_qx_quants``), which ``llama-quantize`` runs when it is given no imatrix. ggml builds them in its base
library without ``-march=native`` (no fused multiply-add), so every float32 operation here is done in the same
order as there: sums run one term after another (a block's values down the first axis, added row by row),
``nearest_int`` is a round half to even, and the search over candidate scales goes step by step, as in C. The
blocks are independent, so each step runs on all of a chunk's blocks at once, and the chunks on every core
(numpy releases the GIL in its loops): on 2 cores, 1.7x one core's speed.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

QK_K = 256  # values in one super-block
F32 = np.float32
EPS = F32(1e-15)  # ggml's GROUP_MAX_EPS: a block whose values are all below it is all zero
CHUNK = 1024  # super-blocks quantized at once: 1 MiB of values; 4096 ran 25% slower (caches)


def _sequential_sum(values: np.ndarray) -> np.ndarray:
    """The first axis summed one term after another, in float32, as a C loop sums it (the values of a block
    run down the first axis, so each addition is one vector operation across blocks)."""
    total = values[0].copy()
    for row in values[1:]:
        total += row
    return total


def _nearest_int(values: np.ndarray) -> np.ndarray:
    """ggml's ``nearest_int``: round half to even (it adds 1.5 * 2^23 and reads the mantissa)."""
    return np.rint(values).astype(np.int32)


def _fp16(values: np.ndarray) -> np.ndarray:
    """``GGML_FP32_TO_FP16`` (round to nearest even), and back to float32 as ``GGML_FP16_TO_FP32``."""
    half = values.astype(np.float16)
    return half, half.astype(F32)


def make_qkx2_quants(
    x: np.ndarray, weights: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Levels 0..nmax, a scale and a min for each column of ``x`` [32, blocks]: the weighted least-squares fit of
    ``scale * level - min`` over ``nstep + 1`` candidate scales. Returns (levels, scale, the_min)."""
    low = np.minimum(x.min(axis=0), F32(0))
    high = x.max(axis=0)
    sum_w = _sequential_sum(weights)
    sum_x = _sequential_sum(weights * x)
    flat = high == low
    iscale = F32(nmax) / np.where(flat, F32(1), high - low)
    scale = F32(1) / iscale
    levels = np.clip(_nearest_int(iscale * (x - low)), 0, nmax)
    diff = scale * levels.astype(F32) + low - x
    best_error = _sequential_sum(weights * (diff * diff))
    for step in range(nstep + 1):
        iscale = (F32(rmin) + F32(rdelta) * F32(step) + F32(nmax)) / np.where(flat, F32(1), high - low)
        ell = np.subtract(x, low)
        ell *= iscale
        np.clip(np.rint(ell, out=ell), 0, nmax, out=ell)  # nearest_int, as float32
        weighted = weights * ell
        sum_l = _sequential_sum(weighted)
        sum_l2 = _sequential_sum(weighted * ell)
        sum_xl = _sequential_sum(weighted * x)
        det = sum_w * sum_l2 - sum_l * sum_l
        solvable = det > 0
        safe_det = np.where(solvable, det, F32(1))
        this_scale = (sum_w * sum_xl - sum_x * sum_l) / safe_det
        this_min = (sum_l2 * sum_x - sum_l * sum_xl) / safe_det
        positive = this_min > 0
        this_min = np.where(positive, F32(0), this_min)
        this_scale = np.where(positive, sum_xl / np.where(sum_l2 == 0, F32(1), sum_l2), this_scale)
        diff = this_scale * ell + this_min - x
        error = _sequential_sum(weights * (diff * diff))
        better = solvable & (error < best_error) & ~flat
        np.copyto(levels, ell.astype(np.int32), where=better)
        best_error = np.where(better, error, best_error)
        scale = np.where(better, this_scale, scale)
        low = np.where(better, this_min, low)
    return np.where(flat, 0, levels), np.where(flat, F32(0), scale), -low


def make_qx_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Levels 0..2*nmax-1 and a signed scale for each column of ``x`` [16, blocks], weighted by x², over 19
    candidate scales around the one that maps the largest magnitude to -nmax (``make_qx_quants``, rmse_type 1)."""
    biggest = np.abs(x).argmax(axis=0)
    peak = np.take_along_axis(x, biggest[None], axis=0)[0]
    zero = np.abs(peak) < EPS
    peak = np.where(zero, F32(1), peak)
    weights = x * x

    def fit(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        level = np.clip(_nearest_int(iscale * x), -nmax, nmax - 1)
        ell = level.astype(F32)
        return level + nmax, _sequential_sum(weights * x * ell), _sequential_sum(weights * ell * ell)

    levels, sumlx, suml2 = fit(F32(-nmax) / peak)
    scale = np.where(suml2 != 0, sumlx / np.where(suml2 == 0, F32(1), suml2), F32(0))
    best = scale * sumlx
    for step in (*range(-9, 0), *range(1, 10)):
        candidate, sumlx, suml2 = fit(-(F32(nmax) + F32(0.1) * F32(step)) / peak)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        levels = np.where(better, candidate, levels)
        scale = np.where(better, sumlx / np.where(suml2 == 0, F32(1), suml2), scale)
        best = np.where(better, scale * sumlx, best)
    return np.where(zero, 0, levels), np.where(zero, F32(0), scale)


def _pack_scale_min(scale_levels: np.ndarray, min_levels: np.ndarray) -> np.ndarray:
    """The 12 bytes of 8 six-bit scales and 8 six-bit mins of a Q4_K or Q5_K super-block."""
    ls, lm = scale_levels.astype(np.uint8), min_levels.astype(np.uint8)
    packed = np.zeros((ls.shape[0], 12), dtype=np.uint8)
    packed[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    return packed


def _scale_min_k(x: np.ndarray, nmax: int, rmin: float, nstep: int) -> tuple[np.ndarray, ...]:
    """The shared part of Q4_K and Q5_K for super-blocks ``x`` [n, 256]: (d, dmin, packed scales, levels)."""
    blocks = x.shape[0]
    sub = np.ascontiguousarray(x.reshape(blocks * 8, 32).T)  # [32, sub-blocks]: each sub-block a column
    av_x = np.sqrt(_sequential_sum(sub * sub) / F32(32))
    weights = av_x + np.abs(sub)
    levels, scales, mins = make_qkx2_quants(sub, weights, nmax, rmin, 0.1, nstep)
    scales, mins, levels = scales.reshape(blocks, 8), mins.reshape(blocks, 8), levels.T.reshape(blocks, 8, 32)
    max_scale = np.maximum(scales.max(axis=-1), F32(0))
    max_min = np.maximum(mins.max(axis=-1), F32(0))
    inv_scale = np.where(max_scale > 0, F32(63) / np.where(max_scale > 0, max_scale, F32(1)), F32(0))
    inv_min = np.where(max_min > 0, F32(63) / np.where(max_min > 0, max_min, F32(1)), F32(0))
    ls = np.minimum(_nearest_int(inv_scale[:, None] * scales) & 0xFF, 63)
    lm = np.minimum(_nearest_int(inv_min[:, None] * mins) & 0xFF, 63)
    d16, d = _fp16(max_scale / F32(63))
    dmin16, dmin = _fp16(max_min / F32(63))
    step = d[:, None] * ls.astype(F32)
    offset = dmin[:, None] * lm.astype(F32)
    nonzero = step != 0
    safe = np.where(nonzero, step, F32(1))
    requantized = np.clip(_nearest_int((x.reshape(blocks, 8, 32) + offset[..., None]) / safe[..., None]), 0, nmax)
    levels = np.where(nonzero[..., None], requantized, levels).reshape(blocks, QK_K).astype(np.uint8)
    header = np.concatenate([d16[:, None].view(np.uint8), dmin16[:, None].view(np.uint8)], axis=-1)
    return np.concatenate([header, _pack_scale_min(ls, lm)], axis=-1), levels


def _q4_k(x: np.ndarray) -> np.ndarray:
    header, levels = _scale_min_k(x, 15, -1.0, 20)
    halves = levels.reshape(-1, 4, 2, 32)  # 4 runs of 64: the first 32 in the low nibbles, the next in the high
    qs = (halves[:, :, 0] | (halves[:, :, 1] << 4)).reshape(-1, 128)
    return np.concatenate([header, qs], axis=-1)


def _q5_k(x: np.ndarray) -> np.ndarray:
    header, levels = _scale_min_k(x, 31, -0.5, 15)
    halves = levels.reshape(-1, 4, 2, 32)
    low = halves & 0xF
    qs = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(-1, 128)
    bits = (halves >> 4).reshape(-1, 8, 32)  # the fifth bit of run n's first and second halves: bits 2n and 2n+1
    qh = np.zeros((x.shape[0], 32), dtype=np.uint8)
    for bit in range(8):
        qh |= bits[:, bit] << bit
    return np.concatenate([header, qh, qs], axis=-1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    blocks = x.shape[0]
    levels, scales = make_qx_quants(np.ascontiguousarray(x.reshape(blocks * 16, 16).T), 32)
    levels, scales = levels.T.reshape(blocks, 16, 16), scales.reshape(blocks, 16)
    biggest = np.abs(scales).argmax(axis=-1)
    max_scale = np.take_along_axis(scales, biggest[:, None], axis=-1)[:, 0]
    zero = np.abs(max_scale) < EPS
    iscale = F32(-128) / np.where(zero, F32(1), max_scale)
    d16, d = _fp16(F32(1) / iscale)
    small = np.minimum(_nearest_int(iscale[:, None] * scales), 127).astype(np.int8)
    step = d[:, None] * small.astype(F32)
    nonzero = step != 0
    safe = np.where(nonzero, step, F32(1))
    requantized = np.clip(_nearest_int(x.reshape(blocks, 16, 16) / safe[..., None]), -32, 31) + 32
    levels = np.where(nonzero[..., None], requantized, levels).reshape(blocks, 2, 4, 32).astype(np.uint8)
    low, high = levels & 0xF, levels >> 4  # per run of 128: 4 quarters of 32
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=-1)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    packed = np.concatenate(
        [ql.reshape(blocks, 128), qh.reshape(blocks, 64), small.view(np.uint8), d16[:, None].view(np.uint8)], axis=-1
    )
    packed[zero] = 0  # ggml writes an all-zero block (d = 0) where every scale is below GROUP_MAX_EPS
    return packed


QUANTIZERS = {"Q4_K": (_q4_k, 144), "Q5_K": (_q5_k, 176), "Q6_K": (_q6_k, 210)}


def quantize_k(values: np.ndarray, kind: str) -> np.ndarray:
    """``values`` [..., n] (n a multiple of 256) as the bytes of ``kind`` (Q4_K, Q5_K or Q6_K), [..., n / 256 *
    block bytes], as ``gguf.quants.quantize`` returns the types it writes."""
    quantizer, block_bytes = QUANTIZERS[kind]
    if values.shape[-1] % QK_K:
        raise ValueError(f"{kind} needs rows of a multiple of {QK_K} values, not {values.shape[-1]}")
    blocks = np.ascontiguousarray(values, dtype=F32).reshape(-1, QK_K)
    out = np.empty((blocks.shape[0], block_bytes), dtype=np.uint8)

    def chunk(start: int) -> None:
        out[start : start + CHUNK] = quantizer(blocks[start : start + CHUNK])

    starts = range(0, blocks.shape[0], CHUNK)
    workers = min(len(starts), len(os.sched_getaffinity(0)))
    if workers <= 1:
        for start in starts:
            chunk(start)
    else:
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(chunk, starts))
    return out.reshape(*values.shape[:-1], values.shape[-1] // QK_K * block_bytes)
