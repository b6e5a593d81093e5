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

__all__ = ["attention"]

SOURCE = "attention_fwd.cu"
DTYPES = ("float16", "bfloat16")
# head_dim -> (warps a block, 16-row m-tiles a warp, keys a staged tile, keys a compute
# sub-tile, Q fragments in registers). Measured: docs/notes-attention.md.
FWD_CONFIGS = {64: (4, 2, 64, 64, True), 128: (4, 2, 32, 32, False)}
HEAD_DIMS = tuple(FWD_CONFIGS)
LOG2E = 1.4426950408889634


def _fwd_instance(ctype: str, d: int, causal: bool) -> tuple[str, int, int, int]:
    """(instance, warps, query rows a block, keys a tile)."""
    warps, mt, bn, bnc, qreg = FWD_CONFIGS[d]
    name = (f"attention_fwd<{ctype}, {d}, {warps}, {mt}, {bn}, {bnc}, {'true' if qreg else 'false'}, "
            f"{'true' if causal else 'false'}>")
    return name, warps, 16 * mt * warps, bn


def instances() -> list[str]:
    """Every kernel instance the front can launch (for the compile check)."""
    return [_fwd_instance(_arrays.DTYPES[dt][0], d, c)[0]
            for dt in DTYPES for d in HEAD_DIMS for c in (False, True)]


def _check(arr, name: str) -> DeviceArray:
    a = _arrays.as_device_array(arr, name, dtypes=("float32",) + DTYPES)
    if a.dtype == "float32":
        raise ValueError(f"{name}: float32 is not supported: attention runs on tensor cores in float16 "
                         "or bfloat16 (softmax and accumulation are float32 inside); cast q, k and v")
    if a.ndim != 4:
        raise ValueError(f"{name}: expected (batch, seqlen, heads, head_dim), got shape {a.shape}")
    # cp.async moves 16-byte chunks: rows must start 16-byte aligned; else read a copy.
    if (a.shape[-1] > 1 and a.strides[-1] != 1) or a.ptr % 16 or any(st % 8 for st in a.strides[:3]):
        a = a.contiguous()
    return a


def _scale(softmax_scale, d: int) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(d)
    try:
        s = float(softmax_scale)
    except (TypeError, ValueError):
        raise TypeError(f"softmax_scale: expected a number, got {type(softmax_scale).__name__}") from None
    if not (math.isfinite(s) and s > 0):
        raise ValueError(f"softmax_scale: must be finite and positive, got {softmax_scale}")
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
    if D not in HEAD_DIMS:
        raise ValueError(f"q: head_dim {D} is not supported (supported: {', '.join(map(str, HEAD_DIMS))})")
    scale = _scale(softmax_scale, D)
    device = _arrays.same_device(qa, ka, va)
    if B * H > 65535:
        raise ValueError(f"q: batch * heads = {B * H} exceeds 65535 (one grid axis); split the batch")

    out = _arrays.empty(qa, (B, Sq, H, D))
    lse = _arrays.empty(qa, (B, H, Sq), "float32") if return_lse else None
    if B * H * Sq:
        inst, warps, bm, bn = _fwd_instance(qa.ctype, D, bool(causal))
        smem = (bm + 4 * bn) * D * qa.itemsize
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
