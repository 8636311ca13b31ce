"""Values for the k-quant tests that are the same bits on every machine: from integer hashing and exact float64
operations (sums and products of a few terms, scalings by powers of two; no libm call), so a digest of their
quantized bytes recorded from ggml holds anywhere."""

from __future__ import annotations

import numpy as np

ROWS = 192


def _uniform(index: np.ndarray, salt: int) -> tuple[np.ndarray, np.ndarray]:
    """A hash of each index, and it as a float64 in [-0.5, 0.5) (exact: 32 bits over 2^32)."""
    hashed = (index * np.uint64(2654435761) + np.uint64(salt)) % np.uint64(2**32)
    hashed = (hashed ^ (hashed >> np.uint64(15))) * np.uint64(2246822519) % np.uint64(2**32)
    return hashed, hashed.astype(np.float64) / 2**32 - 0.5


def fixed_values() -> np.ndarray:
    """[192, 1024] float32 rows of the kinds a weight matrix holds, and edge cases: rows 0-95 near-normal (std
    0.018; rows 0-47 rounded to bf16 as weights saved in bf16), 96-111 heavy-tailed, 112-127 sparse, 128-143 of
    one sign, 144-159 with outliers, 160-175 multiples of 1/16, 176-183 tiny (1e-13), 184-187 constant, 188-191
    zero."""
    index = np.arange(ROWS * 1024, dtype=np.uint64).reshape(ROWS, 1024)
    hashed, u1 = _uniform(index, 1)
    u2, u3, u4 = (_uniform(index, salt)[1] for salt in (2, 3, 4))
    near_normal = (u1 + u2 + u3 + u4) * 2**-5
    parts = [
        near_normal[0:96],
        u1[96:112] * u1[96:112] * u1[96:112],
        np.where(hashed[112:128] % 17 == 0, u2[112:128], 0.0),
        np.abs(near_normal[128:144]),
        near_normal[144:160] + np.where(hashed[144:160] % 509 == 0, 0.5, 0.0),
        np.round(u3[160:176] * 64) / 16,
        near_normal[176:184] * 2**-40,
        np.repeat(u4[184:188, :1], 1024, axis=1),
        np.zeros((4, 1024)),
    ]
    values = np.concatenate(parts).astype(np.float32)
    bits = values[:48].view(np.uint32)  # round to nearest even at bf16's 16 bits
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    values[:48] = rounded.view(np.float32)
    return values
