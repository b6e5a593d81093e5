"""Philox4x32-10 in NumPy, bit for bit the device's (``cuda_src/common/philox.cuh``): the
references draw the same random words as the kernels, so a reference with dropout drops exactly
the elements a kernel drops."""
from __future__ import annotations

import numpy as np

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint32(0x9E3779B9), np.uint32(0xBB67AE85)
_LO = np.uint64(0xFFFFFFFF)
_SHIFT = np.uint64(32)


def philox4x32_10(counter, key) -> np.ndarray:
    """The four output words of each counter: ``counter`` (..., 4) and ``key`` (2,) (or
    broadcastable to (..., 2)) of unsigned 32-bit values; returns (..., 4) uint32."""
    c = np.asarray(counter, dtype=np.uint32)
    k = np.asarray(key, dtype=np.uint32)
    x, y, z, w = (c[..., n].copy() for n in range(4))
    k0, k1 = k[..., 0].copy(), k[..., 1].copy()
    with np.errstate(over="ignore"):
        for r in range(10):
            if r:
                k0 = k0 + _W0
                k1 = k1 + _W1
            p0 = x.astype(np.uint64) * _M0
            p1 = z.astype(np.uint64) * _M1
            hi0, lo0 = (p0 >> _SHIFT).astype(np.uint32), (p0 & _LO).astype(np.uint32)
            hi1, lo1 = (p1 >> _SHIFT).astype(np.uint32), (p1 & _LO).astype(np.uint32)
            x, y, z, w = hi1 ^ y ^ k0, lo1, hi0 ^ w ^ k1, lo0
    return np.stack([x, y, z, w], axis=-1)


def dropout_threshold(p: float) -> int:
    """The drop probability as the 16-bit value a random half-word must reach to keep its
    element: floor(p * 2^16), at most 2^16 - 1 (an element is kept with probability
    1 - threshold / 2^16)."""
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p: must be in [0, 1), got {p}")
    return min(int(p * 65536.0), 0xFFFF)


def dropout_keep(seed: int, offset: int, bh, rows, keys, p: float) -> np.ndarray:
    """Attention dropout's keep mask (True: kept) for every (bh, row, key) of the broadcast of
    ``bh``, ``rows`` and ``keys`` (integer arrays), as the device's ``dropout_keep2`` draws it:
    the counter (call, row, bh, offset) with call = (key // 32) * 4 + (key // 2) % 4, key seed;
    word (key // 8) % 4 of the four, its low 16 bits for an even key, the high for an odd one."""
    bh, rows, keys = np.broadcast_arrays(*(np.asarray(a, dtype=np.int64) for a in (bh, rows, keys)))
    call = ((keys >> 5) << 2) | ((keys >> 1) & 3)
    counter = np.stack([call, rows, bh, np.full(keys.shape, offset)], axis=-1).astype(np.uint32)
    words = philox4x32_10(counter, np.array([seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF], dtype=np.uint32))
    word = np.take_along_axis(words, ((keys >> 3) & 3)[..., None], axis=-1)[..., 0]
    half = (word >> (16 * (keys & 1)).astype(np.uint32)) & np.uint32(0xFFFF)
    return half >= np.uint32(dropout_threshold(p))
