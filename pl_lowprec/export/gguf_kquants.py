"""llama.cpp's k-quants Q2_K to Q6_K, written as ``llama-quantize`` writes them without an importance matrix.

The ``gguf`` package reads these types but cannot write them (its ``quantize`` raises for them), and Q4_K_M,
Ollama's default, is made of them. This is a numpy port of ggml's reference quantizers (``ggml-quants.c``:
``quantize_row_q2_K_ref`` to ``quantize_row_q6_K_ref`` and their ``make_qkx2_quants``, ``make_q3_quants`` and
``make_qx_quants``), which ``llama-quantize`` runs when it is given no imatrix. ggml builds them in its base
library without ``-march=native`` (no fused multiply-add), so every float32 operation here is done in the same
order as there: sums run one term after another (a block's values down the first axis, added row by row),
``nearest_int`` is a round half to even, and the search over candidate scales goes step by step, as in C. The
blocks are independent, so each step runs on all of a chunk's blocks at once, and the chunks on every core
(numpy releases the GIL in its loops): on 2 cores, 1.7x one core's speed.
"""

from __future__ import annotations

import os
from collections.abc import Callable
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
    """ggml's ``nearest_int``: it adds 1.5 * 2^23 and reads the mantissa, a round half to even for magnitudes
    below 2^22 (and, as in C, a wrapped value beyond them)."""
    shifted = (np.asarray(values, dtype=F32) + F32(12582912)).view(np.int32)
    return (shifted & 0x7FFFFF) - 0x400000


def _fp16(values: np.ndarray) -> np.ndarray:
    """``GGML_FP32_TO_FP16`` (round to nearest even), and back to float32 as ``GGML_FP16_TO_FP32``."""
    half = values.astype(np.float16)
    return half, half.astype(F32)


def make_qkx2_quants(
    x: np.ndarray, weights: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Levels 0..nmax, a scale and a min for each column of ``x`` [n, blocks]: the weighted least-squares fit of
    ``scale * level - min`` over ``nstep + 1`` candidate scales, each judged by its weighted squared error (or
    absolute error, ``use_mad``). Returns (levels, scale, the_min)."""

    def error(diff: np.ndarray) -> np.ndarray:
        return _sequential_sum(weights * (np.abs(diff) if use_mad else diff * diff))

    low = np.minimum(x.min(axis=0), F32(0))
    high = x.max(axis=0)
    sum_w = _sequential_sum(weights)
    sum_x = _sequential_sum(weights * x)
    flat = high == low
    iscale = F32(nmax) / np.where(flat, F32(1), high - low)
    scale = F32(1) / iscale
    levels = np.clip(_nearest_int(iscale * (x - low)), 0, nmax)
    best_error = error(scale * levels.astype(F32) + low - x)
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
        this_error = error(this_scale * ell + this_min - x)
        better = solvable & (this_error < best_error) & ~flat
        np.copyto(levels, ell.astype(np.int32), where=better)
        best_error = np.where(better, this_error, best_error)
        scale = np.where(better, this_scale, scale)
        low = np.where(better, this_min, low)
    return np.where(flat, 0, levels), np.where(flat, F32(0), scale), -low


def make_q3_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Levels 0..2*nmax-1 and a signed scale for each column of ``x`` [16, blocks] (``make_q3_quants`` with
    do_rmse): start from the scale that maps the largest magnitude to -nmax, then up to 5 passes that move one
    level at a time, in order, where that raises the x²-weighted fit (a pass that moves none leaves every later
    pass the same, so all 5 run here)."""
    biggest = np.abs(x).argmax(axis=0)
    peak = np.take_along_axis(x, biggest[None], axis=0)[0]
    zero = np.abs(peak) < EPS
    iscale = F32(-nmax) / np.where(zero, F32(1), peak)
    levels = np.clip(_nearest_int(iscale * x), -nmax, nmax - 1).astype(F32)
    weights = x * x
    weighted_x = weights * x
    sumlx = _sequential_sum(weighted_x * levels)
    suml2 = _sequential_sum(weights * levels * levels)
    for _ in range(5):
        for i in range(x.shape[0]):
            level = levels[i]
            slx = sumlx - weighted_x[i] * level
            sl2 = suml2 - weights[i] * level * level
            positive = slx > 0
            new = np.clip(_nearest_int(x[i] * sl2 / np.where(positive, slx, F32(1))), -nmax, nmax - 1).astype(F32)
            slx = slx + weighted_x[i] * new
            sl2 = sl2 + weights[i] * new * new
            better = positive & (new != level) & (sl2 > 0) & (slx * slx * suml2 > sumlx * sumlx * sl2)
            levels[i] = np.where(better, new, level)
            sumlx = np.where(better, slx, sumlx)
            suml2 = np.where(better, sl2, suml2)
    scale = np.where(suml2 > 0, sumlx / np.where(suml2 > 0, suml2, F32(1)), F32(0))
    return np.where(zero, 0, levels.astype(np.int32) + nmax), np.where(zero, F32(0), scale)


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


def _signed_sub_blocks(
    x: np.ndarray, quants: Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]], nmax: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q3_K's and Q6_K's first step for super-blocks ``x`` [n, 256]: each sub-block of 16 fitted by ``quants``
    (levels [n, 16, 16], signed scales [n, 16]), and each super-block's scale of largest magnitude, signed (the
    first of equals, as C's strict ``>`` keeps it)."""
    blocks = x.shape[0]
    levels, scales = quants(np.ascontiguousarray(x.reshape(blocks * 16, 16).T), nmax)
    levels, scales = levels.T.reshape(blocks, 16, 16), scales.reshape(blocks, 16)
    biggest = np.abs(scales).argmax(axis=-1)
    return levels, scales, np.take_along_axis(scales, biggest[:, None], axis=-1)[:, 0]


def _pack_2bit(levels: np.ndarray) -> np.ndarray:
    """The 64 bytes of 256 two-bit levels [n, 256] (Q2_K, and Q3_K's low bits): per run of 128, byte l holds
    levels l, l+32, l+64 and l+96."""
    quarters = levels.astype(np.uint8).reshape(-1, 2, 4, 32)
    packed = quarters[:, :, 0] | (quarters[:, :, 1] << 2) | (quarters[:, :, 2] << 4) | (quarters[:, :, 3] << 6)
    return packed.reshape(-1, 64)


def _q2_k(x: np.ndarray) -> np.ndarray:
    blocks = x.shape[0]
    sub = np.ascontiguousarray(x.reshape(blocks * 16, 16).T)  # [16, sub-blocks]
    levels, scales, mins = make_qkx2_quants(sub, np.abs(sub), 3, -0.5, 0.1, 15, use_mad=True)
    scales, mins, levels = scales.reshape(blocks, 16), mins.reshape(blocks, 16), levels.T.reshape(blocks, 16, 16)
    max_scale = np.maximum(scales.max(axis=-1), F32(0))
    max_min = np.maximum(mins.max(axis=-1), F32(0))
    inv_scale = F32(15) / np.where(max_scale > 0, max_scale, F32(1))
    inv_min = F32(15) / np.where(max_min > 0, max_min, F32(1))
    packed = np.where(max_scale[:, None] > 0, _nearest_int(inv_scale[:, None] * scales), 0) & 0xFF
    packed |= np.where(max_min[:, None] > 0, _nearest_int(inv_min[:, None] * mins) << 4, 0) & 0xFF
    d16, d = _fp16(np.where(max_scale > 0, max_scale / F32(15), F32(0)))
    dmin16, dmin = _fp16(np.where(max_min > 0, max_min / F32(15), F32(0)))
    step = d[:, None] * (packed & 0xF).astype(F32)
    offset = dmin[:, None] * (packed >> 4).astype(F32)
    nonzero = step != 0
    safe = np.where(nonzero, step, F32(1))
    requantized = np.clip(_nearest_int((x.reshape(blocks, 16, 16) + offset[..., None]) / safe[..., None]), 0, 3)
    levels = np.where(nonzero[..., None], requantized, levels).reshape(blocks, QK_K)
    tail = np.concatenate([d16[:, None].view(np.uint8), dmin16[:, None].view(np.uint8)], axis=-1)
    return np.concatenate([packed.astype(np.uint8), _pack_2bit(levels), tail], axis=-1)


def _q3_k(x: np.ndarray) -> np.ndarray:
    blocks = x.shape[0]
    levels, scales, max_scale = _signed_sub_blocks(x, make_q3_quants, 4)
    scaled = max_scale != 0
    iscale = F32(-32) / np.where(scaled, max_scale, F32(1))
    small = np.where(scaled[:, None], np.clip(_nearest_int(iscale[:, None] * scales), -32, 31) + 32, 0)
    packed = np.zeros((blocks, 12), dtype=np.uint8)  # low nibbles of 0-7 then 8-15 in bytes 0-7; high bits 8-11
    packed[:, :8] = (small[:, :8] & 0xF) | ((small[:, 8:] & 0xF) << 4)
    for quarter in range(4):
        packed[:, 8:] |= ((small[:, 4 * quarter : 4 * quarter + 4] >> 4) << (2 * quarter)).astype(np.uint8)
    d16, d = _fp16(np.where(scaled, F32(1) / iscale, F32(0)))
    step = d[:, None] * (small - 32).astype(F32)
    nonzero = step != 0
    safe = np.where(nonzero, step, F32(1))
    requantized = np.clip(_nearest_int(x.reshape(blocks, 16, 16) / safe[..., None]), -4, 3) + 4
    levels = np.where(nonzero[..., None], requantized, levels).reshape(blocks, 8, 32)
    hmask = np.zeros((blocks, 32), dtype=np.uint8)  # bit b of byte m: the high bit of level 32 * b + m
    for bit in range(8):
        hmask |= (levels[:, bit] > 3).astype(np.uint8) << bit
    low = _pack_2bit((levels & 3).reshape(blocks, QK_K))
    return np.concatenate([hmask, low, packed, d16[:, None].view(np.uint8)], axis=-1)


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
    levels, scales, max_scale = _signed_sub_blocks(x, make_qx_quants, 32)
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


QUANTIZERS = {
    "Q2_K": (_q2_k, 84),
    "Q3_K": (_q3_k, 110),
    "Q4_K": (_q4_k, 144),
    "Q5_K": (_q5_k, 176),
    "Q6_K": (_q6_k, 210),
}


def quantize_k(values: np.ndarray, kind: str) -> np.ndarray:
    """``values`` [..., n] (n a multiple of 256) as the bytes of ``kind`` (Q2_K to Q6_K), [..., n / 256 *
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
