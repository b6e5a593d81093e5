"""Fused attention on tensor cores (kernels: cuda_src/attention_fwd.cu).

Layout as flash-attention: q (batch, seqlen_q, heads, head_dim), k and v (batch, seqlen_k,
kv_heads, head_dim) with kv_heads dividing heads (grouped-query and multi-query attention
read the shared K/V heads in place). dtypes: float16, bfloat16 (the tensor-core types);
softmax and accumulation in float32. The log-sum-exp is float32 (batch, heads, seqlen_q).
"""
from __future__ import annotations

import math

import numpy as np

from . import _arrays, _kernels
from ._arrays import DeviceArray

__all__ = ["attention", "attention_backward"]

SOURCE = "attention_fwd.cu"
BWD_SOURCE = "attention_bwd.cu"
DTYPES = ("float16", "bfloat16")
# head_dim -> (warps a block, 16-row m-tiles a warp, keys a staged tile, keys a compute
# sub-tile, Q fragments in registers). Measured: docs/notes-attention.md.
FWD_CONFIGS = {32: (4, 2, 64, 64, True), 64: (4, 2, 64, 64, True), 96: (4, 2, 32, 32, False),
               128: (4, 2, 32, 32, False), 256: (4, 1, 32, 32, False)}
HEAD_DIMS = tuple(FWD_CONFIGS)
# head_dim -> backward block (cuda_src/attention_bwd.cu, attention_bwd_dkdv): (queries a step,
# keys a block, warps, warps over queries in S = Q K^T, warps over keys in dK/dV, warps over
# queries in dQ). Register budget: the dK and dV accumulators (keys x D) spread over all warps.
BWD_CONFIGS = {32: (128, 128, 8, 4, 8, 4), 64: (128, 128, 8, 4, 4, 4), 96: (64, 128, 8, 2, 4, 4),
               128: (64, 128, 8, 2, 4, 2), 256: (64, 64, 8, 4, 2, 2)}
# head_dim -> deterministic dQ kernel (attention_bwd_dq): (warps of 16 queries, keys a tile).
DQ_CONFIGS = {32: (4, 64), 64: (4, 64), 96: (4, 64), 128: (4, 64), 256: (4, 32)}
BWD_HEAD_DIMS = tuple(BWD_CONFIGS)


def _row_elems(d: int) -> int:
    """Shared-memory row length of the kernels (row_elems in cuda_src/common/attn_tile.cuh)."""
    return 64 if d <= 64 else -(-d // 64) * 64
DOT_THREADS = 256
LOG2E = 1.4426950408889634


def _fwd_instance(ctype: str, d: int, causal: bool) -> tuple[str, int, int, int]:
    """(instance, warps, query rows a block, keys a tile)."""
    warps, mt, bn, bnc, qreg = FWD_CONFIGS[d]
    name = (f"attention_fwd<{ctype}, {d}, {warps}, {mt}, {bn}, {bnc}, {'true' if qreg else 'false'}, "
            f"{'true' if causal else 'false'}>")
    return name, warps, 16 * mt * warps, bn


def _bwd_instances(ctype: str, d: int, causal: bool, deterministic: bool) -> tuple[str, ...]:
    """The backward's kernels in launch order: Dsum, dK/dV, then dQ (deterministic) or
    dK/dV with atomic dQ partial sums and their conversion."""
    c = "true" if causal else "false"
    dot = f"attention_bwd_dot<{ctype}, {d}>"
    dkdv = (f"attention_bwd_dkdv<{ctype}, {d}, {', '.join(map(str, BWD_CONFIGS[d]))}, {c}, "
            f"{'false' if deterministic else 'true'}>")
    if deterministic:
        w2, bn = DQ_CONFIGS[d]
        return dot, dkdv, f"attention_bwd_dq<{ctype}, {d}, {w2}, {bn}, {c}>"
    return dot, dkdv, f"attention_bwd_dq_convert<{ctype}>"


def _bwd_smem(d: int, itemsize: int) -> int:
    """Dynamic shared memory of attention_bwd_dkdv: K, V, Q and dO (double-buffered), P and
    dS, lse and Dsum (double-buffered), and 1 KB to align the tiles."""
    bm, bn = BWD_CONFIGS[d][:2]
    return (2 * bn + 4 * bm) * _row_elems(d) * itemsize + 2 * bm * _row_elems(bn) * itemsize + 4 * bm * 4 + 1024


def instances() -> list[str]:
    """Every forward kernel instance the front can launch (for the compile check)."""
    return [_fwd_instance(_arrays.DTYPES[dt][0], d, c)[0]
            for dt in DTYPES for d in HEAD_DIMS for c in (False, True)]


def bwd_instances() -> list[str]:
    """Every backward kernel instance (cuda_src/attention_bwd.cu)."""
    names = []
    for dt in DTYPES:
        for d in BWD_HEAD_DIMS:
            for c in (False, True):
                for det in (False, True):
                    names += [n for n in _bwd_instances(_arrays.DTYPES[dt][0], d, c, det) if n not in names]
    return names


def _check(arr, name: str) -> DeviceArray:
    a = _arrays.as_device_array(arr, name, dtypes=("float32",) + DTYPES)
    if a.dtype == "float32":
        raise ValueError(f"{name}: float32 is not supported: attention runs on tensor cores in float16 "
                         "or bfloat16 (softmax and accumulation are float32 inside); cast q, k and v")
    if a.ndim != 4:
        raise ValueError(f"{name}: expected (batch, seqlen, heads, head_dim), got shape {a.shape}")
    # cp.async moves 16-byte chunks: rows must start 16-byte aligned; else read a fresh copy
    # (a contiguous view at a misaligned address stays misaligned under contiguous()).
    if (a.shape[-1] > 1 and a.strides[-1] != 1) or a.ptr % 16 or any(st % 8 for st in a.strides[:3]):
        a = a.copy()
    return a


def _check_qkv(q, k, v, head_dims, which: str):
    """(qa, ka, va) after the checks both directions share; ``which`` names the direction in
    the head-dim message ("" or " by the backward")."""
    qa, ka, va = _check(q, "q"), _check(k, "k"), _check(v, "v")
    B, Sq, H, D = qa.shape
    Bk, Sk, Hkv, Dk = ka.shape
    for name, a in (("k", ka), ("v", va)):
        if a.dtype != qa.dtype:
            raise ValueError(f"{name}: dtype {a.dtype} differs from q's {qa.dtype}")
    if va.shape != ka.shape:
        raise ValueError(f"v: shape {va.shape} does not match k's {ka.shape}")
    if Bk != B:
        raise ValueError(f"k: batch {Bk} does not match q's {B}")
    if Dk != D:
        raise ValueError(f"k: head_dim {Dk} does not match q's {D}")
    if Hkv == 0 or H % Hkv:
        raise ValueError(f"k: {Hkv} kv heads do not divide q's {H} heads (grouped-query attention "
                         "needs heads % kv_heads == 0)")
    if D not in head_dims:
        raise ValueError(f"q: head_dim {D} is not supported{which} (supported: "
                         f"{', '.join(map(str, head_dims))})")
    if B * H > 65535:
        raise ValueError(f"q: batch * heads = {B * H} exceeds 65535 (one grid axis); split the batch")
    return qa, ka, va


def _scale(softmax_scale, d: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(d)
    try:
        s = float(softmax_scale)
    except (TypeError, ValueError):
        raise TypeError(f"softmax_scale: expected a number, got {type(softmax_scale).__name__}") from None
    if not (math.isfinite(s) and s > 0):
        raise ValueError(f"softmax_scale: must be finite and positive, got {softmax_scale}")
    # The kernels take scale and scale*log2(e) as float32: both must be normal numbers there
    # (0 or inf would turn masked scores into NaN).
    tiny, big = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)
    if not (tiny <= s and s * LOG2E <= big):
        raise ValueError(f"softmax_scale: {softmax_scale} is outside float32's normal range "
                         f"[{tiny:.3g}, {big / LOG2E:.3g}]")
    return s


def attention(q, k, v, *, causal=False, softmax_scale=None, return_lse=False):
    """softmax(q k^T * softmax_scale [+ causal mask]) v, fused (FlashAttention-2 style).

    Args:
        q: (B, Sq, H, D) float16 or bfloat16 (CuPy array or torch CUDA tensor), unit stride
            over D; other strides (e.g. a slice of a packed qkv tensor) are read in place.
        k, v: (B, Sk, Hkv, D) of q's dtype; Hkv divides H (GQA / MQA).
        causal: mask keys after the query, aligned to the bottom right when Sq != Sk
            (query i sees keys j <= i + Sk - Sq); a query that sees no key outputs zeros.
        softmax_scale: positive; defaults to 1 / sqrt(D).
        return_lse: also return the log-sum-exp (B, H, Sq) float32 (natural log; +inf for a
            query that sees no key).

    Returns:
        ``out`` (B, Sq, H, D) of q's dtype, contiguous; with ``return_lse`` ``(out, lse)``.
    """
    qa, ka, va = _check_qkv(q, k, v, HEAD_DIMS, "")
    B, Sq, H, D = qa.shape
    Sk, Hkv = ka.shape[1], ka.shape[2]
    scale = _scale(softmax_scale, D)
    device = _arrays.same_device(qa, ka, va)

    out = _arrays.empty(qa, (B, Sq, H, D))
    lse = _arrays.empty(qa, (B, H, Sq), "float32") if return_lse else None
    if B * H * Sq:
        inst, warps, bm, bn = _fwd_instance(qa.ctype, D, bool(causal))
        smem = (bm + 4 * bn) * _row_elems(D) * qa.itemsize + 1024   # (+ 1 KB to align the tiles)
        with _arrays.launch_context(qa):
            fn = _kernels.function(SOURCE, inst, device)
            if Sk == 0:  # no keys: zeros, lse = +inf
                _arrays.fill(out, 0.0)
                if lse is not None:
                    _arrays.fill(lse, float("inf"))
            else:
                _kernels.launch(fn, (-(-Sq // bm), B * H), warps * 32, (
                    qa, ka, va, out, lse,
                    *(np.int64(s) for s in qa.strides[:3]), *(np.int64(s) for s in ka.strides[:3]),
                    *(np.int64(s) for s in va.strides[:3]), *(np.int64(s) for s in out.strides[:3]),
                    np.int32(H), np.int32(Hkv), np.int32(Sq), np.int32(Sk), np.float32(scale * LOG2E)),
                    shared_mem=smem)
    return (out.obj, lse.obj) if return_lse else out.obj


def _check_like_q(arr, name: str, ref: DeviceArray) -> DeviceArray:
    a = _check(arr, name)
    if a.shape != ref.shape:
        raise ValueError(f"{name}: shape {a.shape} does not match {ref.name}'s {ref.shape}")
    if a.dtype != ref.dtype:
        raise ValueError(f"{name}: dtype {a.dtype} differs from {ref.name}'s {ref.dtype}")
    return a


def attention_backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, deterministic=False):
    """Gradients of ``attention``: ``(dq, dk, dv)``.

    Args:
        dout: (B, Sq, H, D) gradient of ``out``, q's dtype.
        q, k, v, causal, softmax_scale: as given to the forward.
        out, lse: the forward's output and log-sum-exp (``return_lse=True``).
        deterministic: False (default, as FlashAttention): dQ is summed over key tiles with
            float32 atomics (5 matrix products a tile pair; the last bits of dq may differ run
            to run). True: dQ has its own pass (7 products, about 1.3x the backward's time)
            and every gradient has the same bits on every call. dk and dv are deterministic
            either way (a fixed-order sum over query tiles and heads).

    Returns:
        dq (B, Sq, H, D), dk and dv (B, Sk, Hkv, D) — dk and dv summed over the query heads
        that share each K/V head — contiguous, of q's dtype.
    """
    qa, ka, va = _check_qkv(q, k, v, BWD_HEAD_DIMS, " by the backward")
    B, Sq, H, D = qa.shape
    Sk, Hkv = ka.shape[1], ka.shape[2]
    da = _check_like_q(dout, "dout", qa)
    oa = _check_like_q(out, "out", qa)
    la = _arrays.as_device_array(lse, "lse", dtypes=("float32",))
    if la.shape != (B, H, Sq):
        raise ValueError(f"lse: shape {la.shape} does not match (batch, heads, seqlen_q) = {(B, H, Sq)}")
    la = la.contiguous()
    scale = _scale(softmax_scale, D)
    device = _arrays.same_device(qa, ka, va, da, oa, la)

    dq = _arrays.empty(qa, qa.shape)
    dk = _arrays.empty(qa, ka.shape)
    dv = _arrays.empty(qa, va.shape)
    with _arrays.launch_context(qa):
        if B * H * Sq == 0 or Sk == 0:
            for a in (dq, dk, dv):
                _arrays.fill(a, 0.0)
            return dq.obj, dk.obj, dv.obj
        dot_i, dkdv_i, dq_i = _bwd_instances(qa.ctype, D, bool(causal), bool(deterministic))
        strides = lambda a: tuple(np.int64(s) for s in a.strides[:3])  # noqa: E731
        dsum = _arrays.empty(qa, (B, H, Sq), "float32")
        # deterministic=False: dQ's float32 partial sums (B, Sq, H, D), zeroed by the Dsum
        # kernel, then added to by atomics.
        dq_accum = None if deterministic else _arrays.empty(qa, (B, Sq, H, D), "float32")
        fn = _kernels.function(BWD_SOURCE, dot_i, device)
        rows = B * Sq * H
        _kernels.launch(fn, min(-(-rows // DOT_THREADS), 65535), DOT_THREADS,
                        (da, oa, *strides(da), *strides(oa), dsum, dq_accum, np.int32(B), np.int32(Sq),
                         np.int32(H)))
        tail = (np.int32(H), np.int32(Hkv), np.int32(Sq), np.int32(Sk), np.float32(scale),
                np.float32(scale * LOG2E))
        fn = _kernels.function(BWD_SOURCE, dkdv_i, device)
        bn1, warps = BWD_CONFIGS[D][1:3]
        _kernels.launch(fn, (-(-Sk // bn1), B * Hkv), warps * 32, (
            qa, ka, va, da, la, dsum, dk, dv, dq_accum, *strides(qa), *strides(ka), *strides(va),
            *strides(da), *strides(dk), *strides(dv), *tail), shared_mem=_bwd_smem(D, qa.itemsize))
        fn = _kernels.function(BWD_SOURCE, dq_i, device)
        if deterministic:
            w2, bn = DQ_CONFIGS[D]
            smem = (2 * 16 * w2 + 4 * bn) * _row_elems(D) * qa.itemsize
            _kernels.launch(fn, (-(-Sq // (16 * w2)), B * H), w2 * 32, (
                qa, ka, va, da, la, dsum, dq, *strides(qa), *strides(ka), *strides(va), *strides(da),
                *strides(dq), *tail), shared_mem=smem)
        else:
            n = B * Sq * H * D
            _kernels.launch(fn, min(-(-n // (8 * DOT_THREADS)), 65535 * 16), DOT_THREADS,
                            (dq_accum, dq, np.int64(n), np.float32(scale)))
    return dq.obj, dk.obj, dv.obj
