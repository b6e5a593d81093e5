"""Attention's argument checks, shared by the kernels' front and the references, and the small
layout helpers the launches use."""
from __future__ import annotations

import math

import numpy as np

from .. import _arrays, _checks
from .._arrays import DeviceArray
from .._plans import Builder

# ---- argument checks (kernels and references alike) -----------------------------------------

def _check_rank(a: DeviceArray) -> None:
    if a.dtype == "float32":
        raise ValueError(f"{a.name}: float32 is not supported: attention runs on tensor cores in float16 "
                         "or bfloat16 (softmax and accumulation are float32 inside); cast q, k and v")
    if a.ndim != 4:
        raise ValueError(f"{a.name}: expected (batch, seqlen, heads, head_dim), got shape {a.shape}")


def _check_values(va, ka, values) -> None:
    """v against k: the same shape but for the head size, which is k's, or with ``values``
    True (the references) any of its own, or with ``values`` the kernels' (k's head dim, v's)
    pairs where they differ (MLA's 128 beside q and k's 192)."""
    if va.shape[:-1] != ka.shape[:-1]:
        raise ValueError(f"v: shape {va.shape} does not match k's {ka.shape}")
    if values is True:
        return
    d, dv = ka.shape[-1], va.shape[-1]
    pairs = dict(values or ())
    if dv == pairs.get(d, d):
        return
    if d in pairs:
        raise ValueError(f"v: head_dim {dv} beside q and k's {d}: the kernels take head_dim {d} with a value "
                         f"head size of {pairs[d]}")
    own = "; ".join(f"q and k {a}, v {b}" for a, b in pairs.items()) or "none"
    raise ValueError(f"v: head_dim {dv} differs from k's {d}: the kernels take v's head size equal to q and k's, "
                     f"or these pairs of their own ({own})")


def _check_qkv(qa, ka, va, head_dims, which: str, values=()) -> None:
    """q (B, Sq, H, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv) of one 16-bit dtype; ``values``
    as ``_check_values`` takes it."""
    for a in (qa, ka, va):
        _check_rank(a)
    b, sq, h, d = qa.shape
    bk, sk, hkv, dk = ka.shape
    for a in (ka, va):
        if a.dtype != qa.dtype:
            raise ValueError(f"{a.name}: dtype {a.dtype} differs from q's {qa.dtype}")
    _check_values(va, ka, values)
    if bk != b:
        raise ValueError(f"k: batch {bk} does not match q's {b}")
    if dk != d:
        raise ValueError(f"k: head_dim {dk} does not match q's {d}")
    if hkv == 0 or h % hkv:
        raise ValueError(f"k: {hkv} kv heads do not divide q's {h} heads (grouped-query attention "
                         "needs heads % kv_heads == 0)")
    if head_dims is not None and d not in head_dims:
        raise ValueError(f"q: head_dim {d} is not supported{which} (supported: {', '.join(map(str, head_dims))})")
    if b * h > 65535:
        raise ValueError(f"q: batch * heads = {b * h} exceeds 65535 (one grid axis); split the batch")


def _check_like_q(a: DeviceArray, ref: DeviceArray, shape: tuple | None = None) -> None:
    """``a`` of ``ref``'s dtype and of its shape (or of ``shape``: out and dout with a value head
    size of their own)."""
    _check_rank(a)
    if a.shape != (ref.shape if shape is None else shape):
        what = f"{ref.name}'s {ref.shape}" if shape is None else f"{shape} (q's with v's head_dim)"
        raise ValueError(f"{a.name}: shape {a.shape} does not match {what}")
    if a.dtype != ref.dtype and not (a.kind == "numpy" and "float64" in (a.dtype, ref.dtype)):
        # (the references take float64 beside any dtype: their own results feed their backwards)
        raise ValueError(f"{a.name}: dtype {a.dtype} differs from {ref.name}'s {ref.dtype}")


def _check_lse(la: DeviceArray, qa: DeviceArray) -> None:
    b, sq, h, _ = qa.shape
    if la.shape != (b, h, sq):
        raise ValueError(f"lse: shape {la.shape} does not match (batch, heads, seqlen_q) = {(b, h, sq)}")


def _check_varlen(qa, ka, va, cu_q: DeviceArray, cu_k: DeviceArray, max_seqlen_q, max_seqlen_k, head_dims,
                  which: str, values=()) -> tuple[int, int]:
    """Packed documents: q (total_q, H, D), k and v (total_k, Hkv, D), cu_seqlens_q/k (B + 1)
    int32 offsets of each document's first token. The max lengths as ints."""
    for a in (qa, ka, va):
        if a.dtype == "float32":
            _check_rank(a)
        if a.ndim != 3:
            raise ValueError(f"{a.name}: expected (total_tokens, heads, head_dim) for packed documents, "
                             f"got shape {a.shape}")
    _check_values(va, ka, values)
    for cu in (cu_q, cu_k):
        if cu.dtype != "int32":
            raise ValueError(f"{cu.name}: dtype {cu.dtype}; expected int32 offsets (flash-attn's cu_seqlens)")
        if cu.ndim != 1 or cu.shape[0] < 2:
            raise ValueError(f"{cu.name}: expected (batch + 1,) offsets with batch >= 1, got shape {cu.shape}")
    if cu_k.shape != cu_q.shape:
        raise ValueError(f"cu_seqlens_k: {cu_k.shape[0] - 1} documents, cu_seqlens_q {cu_q.shape[0] - 1}")
    max_q, max_k = _checks.index(max_seqlen_q, "max_seqlen_q"), _checks.index(max_seqlen_k, "max_seqlen_k")
    for name, m, a in (("max_seqlen_q", max_q, qa), ("max_seqlen_k", max_k, ka)):
        if m < 0:
            raise ValueError(f"{name}: must be >= 0, got {m}")
        if m == 0 and a.shape[0] > 0:
            raise ValueError(f"{name}: 0, but {a.name} holds {a.shape[0]} tokens")
    # (the dense checks, on the packed arrays seen as one batch)
    _check_qkv(*(a.batched() for a in (qa, ka, va)), head_dims, which, values)
    if (cu_q.shape[0] - 1) * qa.shape[1] > 65535:
        raise ValueError(f"cu_seqlens_q: documents * heads = {(cu_q.shape[0] - 1) * qa.shape[1]} exceeds 65535 "
                         "(one grid axis); split the batch")
    return max_q, max_k


def _check_cu_values(cu: np.ndarray, name: str, total: int, max_seqlen: int) -> None:
    """The offsets' values (the references check them here; the kernels on the device, as a
    fault that ``cukern.check_errors()`` raises): from 0 to the token count, none decreasing,
    no document longer than max_seqlen."""
    if cu[0] != 0:
        raise ValueError(f"{name}: must start at 0, got {int(cu[0])}")
    steps = np.diff(cu.astype(np.int64))
    if (steps < 0).any():
        i = int(np.argmax(steps < 0))
        raise ValueError(f"{name}: offsets must not decrease, got {int(cu[i])} then {int(cu[i + 1])} at {i}")
    if cu[-1] != total:
        raise ValueError(f"{name}: the last offset {int(cu[-1])} must be the token count {total}")
    if steps.size and steps.max() > max_seqlen:
        i = int(np.argmax(steps))
        raise ValueError(f"{name}: document {i} has {int(steps[i])} tokens, more than max_seqlen {max_seqlen}")


def _scale(softmax_scale, d: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(d)
    # The kernels take scale and scale*log2(e) as float32: both must be normal numbers there
    # (0 or inf would turn masked scores into NaN).
    return _checks.positive_float32(softmax_scale, "softmax_scale", log2e=True)


def _dropout_p(dropout_p, softcap) -> float:
    """``dropout_p`` as a float in [0, 1), checked (the softcap is not taken with dropout)."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p: must be a number in [0, 1), got {dropout_p!r}")
    if dropout_p and softcap:
        raise ValueError(f"dropout_p: {dropout_p} with softcap {softcap}: the kernels take one or the other")
    return float(dropout_p)


def _dropout_rng(dropout_p: float, dropout_rng) -> list:
    """The draw's (seed, offset) as the last array of a call where ``dropout_p`` > 0, else nothing."""
    if not dropout_p:
        return []
    if dropout_rng is None:
        raise ValueError("dropout_rng: dropout_p > 0 needs the draw's seed and Philox offset, a (2,) int64 device "
                         "array on q's device")
    ra = _arrays.as_device_array(dropout_rng, "dropout_rng", ("int64",))
    if ra.shape != (2,):
        raise ValueError(f"dropout_rng: shape {ra.shape}; expected (2,): the seed and the Philox offset")
    return [ra]


def _dropout_args(dropout_p: float, rng_slot) -> dict:
    """The sm_80 kernels' dropout arguments (unused by instances without dropout)."""
    from .._philox import dropout_threshold

    if not dropout_p:
        return dict(drop_rng=None, drop_threshold=0, drop_rescale=1.0)
    return dict(drop_rng=rng_slot, drop_threshold=dropout_threshold(dropout_p), drop_rescale=1.0 / (1.0 - dropout_p))


def _misaligned(a: DeviceArray) -> bool:
    """cp.async moves 16-byte chunks: rows must start 16-byte aligned. Such a view is read from
    a fresh copy (a contiguous view at a misaligned address stays misaligned under contiguous())."""
    return (a.shape[-1] > 1 and a.strides[-1] != 1) or a.ptr % 16 != 0 or any(s % 8 for s in a.strides[:-1])


def _tma_readable(a: DeviceArray) -> bool:
    """A tensor map can describe ``a`` as it is: no axis of several elements is broadcast (a
    stride of 0, as K and V expanded over the heads); those take the sm_80 kernel."""
    return all(s > 0 or n == 1 for n, s in zip(a.shape[:3], a.strides[:3]))


def _strides3(strides) -> dict:
    return dict(zip(("sb", "ss", "sh"), strides[:3]))


def _read(b: Builder, i: int, a: DeviceArray) -> tuple:
    """The batch, sequence and head strides the kernels read input ``i`` with (a fresh copy's
    when it is misaligned: the plan then copies it first)."""
    if _misaligned(a):
        b.fix(i, DeviceArray.copy)
        return _contiguous_strides(a.shape)
    return a.strides


def _contiguous_strides(shape) -> tuple:
    strides, step = [0] * len(shape), 1
    for ax in reversed(range(len(shape))):
        strides[ax] = step
        step *= shape[ax]
    return tuple(strides)


def _like(a: DeviceArray, copied: bool, shape=None) -> tuple:
    """Strides of an output laid out like input ``a`` (after its fix-up, if any), of ``a``'s
    shape or of ``shape`` (its rank: out beside q with v's head size)."""
    shape = a.shape if shape is None else tuple(shape)
    return _contiguous_strides(shape) if copied else _arrays.like_strides(shape, a.strides)
