"""Attention's NumPy references (float64): forward and backward, dense and packed documents."""
from __future__ import annotations

import numpy as np

from .. import _arrays, _attention_mask, _checks
from .._arrays import DeviceArray
from .._attention_mask import Mask
from . import configs as _cfg
from .checks import (_check_cu_values, _check_like_q, _check_lse, _check_qkv, _check_varlen, _dropout_p, _dropout_rng,
                     _scale)

# ---- NumPy references ------------------------------------------------------------------------

def _ref_head_dims(qa: DeviceArray, head_dims):
    """The kernels' head dims for the kernels' dtypes; any for float64, which no kernel takes
    (the tests' exact oracle, at head dims small enough for many hypothesis examples)."""
    return None if qa.dtype == "float64" else head_dims


def _host_qkv(q, k, v, head_dims, which: str = ""):
    qa, ka, va = (_arrays.as_host_array(a, n) for a, n in ((q, "q"), (k, "k"), (v, "v")))
    _check_qkv(qa, ka, va, _ref_head_dims(qa, head_dims), which, values=True)
    return qa, ka, va


def _host_sinks(sinks, h: int):
    """The sinks as float64 (H,), or None."""
    if sinks is None:
        return None
    sa = _arrays.as_host_array(sinks, "sinks", ("float32", "float64"))
    if sa.shape != (h,):
        raise ValueError(f"sinks: shape {sa.shape}; expected (heads,) = ({h},), one logit a query head")
    return sa.obj.astype(np.float64)


def _ref_scores(q, k, scale, mask: Mask, sinks=None):
    """(p, lse, s): softmax probabilities (B, H, Sq, Sk) with rows that see no key all zero,
    the log-sum-exp (+inf for those rows) and the scaled scores before the softcap. ``sinks``
    (H,): a logit a head in every row's denominator (the row's weights then sum to less than
    1, and a row that sees no key has lse = its sink)."""
    batch, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    _attention_mask.softcap_log2(mask, scale)   # (its range checked as the kernels' fronts check it)
    kh = np.repeat(k, h // hkv, axis=2)  # (B, Sk, H, D): query head h reads kv head h // rep
    s = np.einsum("bqhd,bkhd->bhqk", q, kh) * scale
    sc = _attention_mask.capped(s, mask)
    if mask.any:
        sc = np.where(_attention_mask.visible(mask, sq, sk)[None, None], sc, -np.inf)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        m = sc.max(axis=-1, keepdims=True) if sk else np.full(sc.shape[:-1] + (1,), -np.inf)
        if sinks is not None:
            sink = sinks[None, :, None, None]
            m = np.maximum(m, sink)
        m_safe = np.where(np.isfinite(m), m, 0.0)
        p = np.exp(sc - m_safe)
        l_ = p.sum(axis=-1, keepdims=True)
        if sinks is not None:
            l_ = l_ + np.exp(sink - m_safe)
        # (l_ == 0 only where no key is seen; a NaN score makes l_ NaN, and NaN goes on into p
        # and lse, as in torch.softmax)
        none = l_ == 0
        p = np.where(none, 0.0, p / np.where(none, 1.0, l_))
        lse = np.where(none, np.inf, np.log(np.where(none, 1.0, l_)) + m_safe)[..., 0]
    return p, lse, s


def dropout_keep_mask(p: float, seed: int, offset: int, batch: int, heads: int, sq: int, sk: int,
                      q0: int = 0, k0: int = 0) -> np.ndarray:
    """(batch, heads, sq, sk) bool: which attention weights dropout keeps (``cukern._philox``, the
    kernels' draw): element (b, h, i, j) is drawn at (b * heads + h, q0 + i, k0 + j); packed
    documents draw at their tokens' places in the pack (batch 1, q0 and k0 the document's first)."""
    from .. import _philox

    bh = (np.arange(batch)[:, None] * heads + np.arange(heads)[None, :])[:, :, None, None]
    rows = (q0 + np.arange(sq))[None, None, :, None]
    keys = (k0 + np.arange(sk))[None, None, None, :]
    return _philox.dropout_keep(seed, offset, bh, rows, keys, p)


def _ref_forward(qf, kf, vf, scale, mask: Mask, sinks=None, keep=None, p_drop=0.0):
    """(out, lse); ``keep`` (B, H, Sq, Sk) bool: dropout of the weights, the kept scaled by
    1 / (1 - p_drop) (lse is the softmax's, before dropout)."""
    p, lse, _ = _ref_scores(qf, kf, scale, mask, sinks)
    if keep is not None:
        p = np.where(keep, p / (1.0 - p_drop), 0.0)
    vh = np.repeat(vf, qf.shape[2] // kf.shape[2], axis=2)
    return np.einsum("bhqk,bkhd->bqhd", p, vh), lse


def _ref_backward(dof, qf, kf, vf, scale, mask: Mask, sinks=None, keep=None, p_drop=0.0):
    """(dq, dk, dv), and dsinks (H,) after them where ``sinks`` are given; ``keep`` and
    ``p_drop`` as for ``_ref_forward``."""
    batch, sq, h, d = qf.shape
    sk, hkv = kf.shape[1], kf.shape[2]
    rep = h // hkv
    p, lse, s = _ref_scores(qf, kf, scale, mask, sinks)
    kh, vh = np.repeat(kf, rep, axis=2), np.repeat(vf, rep, axis=2)
    dropped = p if keep is None else np.where(keep, p / (1.0 - p_drop), 0.0)
    dvh = np.einsum("bhqk,bqhd->bkhd", dropped, dof)
    dp = np.einsum("bqhd,bkhd->bhqk", dof, vh)
    if keep is not None:   # (the gradient reaches P through the same kept, scaled weights)
        dp = np.where(keep, dp / (1.0 - p_drop), 0.0)
    correction = (p * dp).sum(axis=-1, keepdims=True)   # sum_j P dP = dO . O: the sink has no value
    ds = p * (dp - correction) * _attention_mask.softcap_grad(s, mask)
    dq = np.einsum("bhqk,bkhd->bqhd", ds, kh) * scale
    dkh = np.einsum("bhqk,bqhd->bkhd", ds, qf) * scale
    dv_ = vf.shape[-1]
    grads = (dq, dkh.reshape(batch, sk, hkv, rep, d).sum(axis=3), dvh.reshape(batch, sk, hkv, rep, dv_).sum(axis=3))
    if sinks is None:
        return grads
    # d lse / d sink is the sink's probability; its dP is 0, so dS_sink = -P_sink * correction
    p_sink = np.exp(sinks[None, :, None] - lse)   # (B, H, Sq); lse = +inf only without a sink
    return (*grads, -(p_sink * correction[..., 0]).sum(axis=(0, 2)))


def _host_dropout(dropout_p, dropout_rng, softcap) -> tuple | None:
    """(p, seed, offset) of a call with dropout, else None; ``dropout_rng`` as the kernels take it
    (a (2,) int64 array, on the host or a device) or a (seed, offset) pair of ints."""
    p = _dropout_p(dropout_p, softcap)
    if not p:
        return None
    if isinstance(dropout_rng, (tuple, list)) and len(dropout_rng) == 2 and all(type(x) is int for x in dropout_rng):
        seed, offset = dropout_rng
    else:
        if dropout_rng is None:
            _dropout_rng(p, None)   # (raises: dropout_p > 0 needs the draw)
        ra = _arrays.as_host_array(dropout_rng, "dropout_rng", ("int64",))
        if ra.shape != (2,):
            raise ValueError(f"dropout_rng: shape {ra.shape}; expected (2,): the seed and the Philox offset")
        seed, offset = (int(x) for x in ra.obj)
    return p, seed & 0xFFFFFFFFFFFFFFFF, offset & 0xFFFFFFFF


def _keep(drop, batch: int, heads: int, sq: int, sk: int, q0: int = 0, k0: int = 0):
    """(keep mask or None, p) of a call's dropout (``_host_dropout``'s)."""
    if drop is None:
        return None, 0.0
    p, seed, offset = drop
    return dropout_keep_mask(p, seed, offset, batch, heads, sq, sk, q0, k0), p


def reference_attention(q, k, v, *, causal=False, softmax_scale=None, return_lse=False, window=(-1, -1),
                        softcap=0.0, sinks=None, dropout_p=0.0, dropout_rng=None):
    """``attention`` in float64: out (B, Sq, H, Dv) [, lse (B, H, Sq)] (Dv: v's head size, which
    may differ from q's and k's here, as MLA's 128 beside 192); the mask aligned to the
    bottom right; a query that sees no key gives zeros and lse = +inf (as the kernel; with
    sinks, lse = its sink), one whose scores hold a NaN gives NaN (as torch.softmax)."""
    qa, ka, va = _host_qkv(q, k, v, _cfg.CONFIGS.head_dims)
    mask = _attention_mask.mask_of(causal, window, softcap, qa.shape[1], ka.shape[1])
    qf, kf, vf = (a.obj.astype(np.float64) for a in (qa, ka, va))
    keep, p = _keep(_host_dropout(dropout_p, dropout_rng, softcap), qa.shape[0], qa.shape[2], qa.shape[1], ka.shape[1])
    out, lse = _ref_forward(qf, kf, vf, _scale(softmax_scale, qa.shape[-1]), mask, _host_sinks(sinks, qa.shape[2]),
                            keep, p)
    return (out, lse) if return_lse else out


def reference_attention_backward(dout, q, k, v, out=None, lse=None, *, causal=False, softmax_scale=None,
                                 deterministic=False, window=(-1, -1), softcap=0.0, sinks=None, dropout_p=0.0,
                                 dropout_rng=None):
    """``attention_backward`` in float64: (dq, dk, dv), dk and dv summed over the query heads
    sharing a K/V head, and dsinks (H,) with ``sinks``. ``out`` and ``lse`` are recomputed
    (given ones are shape-checked)."""
    qa, ka, va = _host_qkv(q, k, v, _cfg.CONFIGS.bwd_head_dims, " by the backward")
    mask = _attention_mask.mask_of(causal, window, softcap, qa.shape[1], ka.shape[1])
    da = _arrays.as_host_array(dout, "dout")
    out_shape = (*qa.shape[:-1], va.shape[-1])
    _check_like_q(da, qa, out_shape)
    if out is not None:
        _check_like_q(_arrays.as_host_array(out, "out"), qa, out_shape)
    if lse is not None:
        _check_lse(_arrays.as_host_array(lse, "lse", ("float32",)), qa)
    qf, kf, vf, dof = (a.obj.astype(np.float64) for a in (qa, ka, va, da))
    keep, p = _keep(_host_dropout(dropout_p, dropout_rng, softcap), qa.shape[0], qa.shape[2], qa.shape[1], ka.shape[1])
    return _ref_backward(dof, qf, kf, vf, _scale(softmax_scale, qa.shape[-1]), mask, _host_sinks(sinks, qa.shape[2]),
                         keep, p)


def _host_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, head_dims, which: str = ""):
    qa, ka, va = (_arrays.as_host_array(a, n) for a, n in ((q, "q"), (k, "k"), (v, "v")))
    cq, ck = (_arrays.as_host_array(a, n, ("int32",)) for a, n in ((cu_seqlens_q, "cu_seqlens_q"),
                                                                  (cu_seqlens_k, "cu_seqlens_k")))
    max_q, max_k = _check_varlen(qa, ka, va, cq, ck, max_seqlen_q, max_seqlen_k, _ref_head_dims(qa, head_dims),
                                 which, values=True)
    _check_cu_values(cq.obj, "cu_seqlens_q", qa.shape[0], max_q)
    _check_cu_values(ck.obj, "cu_seqlens_k", ka.shape[0], max_k)
    return qa, ka, va, cq.obj, ck.obj


def reference_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                               softmax_scale=None, return_lse=False, window=(-1, -1), softcap=0.0, sinks=None,
                               dropout_p=0.0, dropout_rng=None):
    """``attention_varlen`` in float64: out (total_q, H, D) [, lse (H, total_q)]; each document
    attends to its own keys only, the mask aligned to the bottom right of each document."""
    qa, ka, va, cq, ck = _host_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      _cfg.CONFIGS.head_dims)
    scale = _scale(softmax_scale, qa.shape[-1])
    sf = _host_sinks(sinks, qa.shape[1])
    drop = _host_dropout(dropout_p, dropout_rng, softcap)
    out = np.zeros((*qa.shape[:-1], va.shape[-1]))
    lse = np.full((qa.shape[1], qa.shape[0]), np.inf)
    for i in range(len(cq) - 1):
        (q0, q1), (k0, k1) = cq[i:i + 2], ck[i:i + 2]
        mask = _attention_mask.mask_of(causal, window, softcap, int(q1 - q0), int(k1 - k0))
        qf, kf, vf = (a.obj[None, r0:r1].astype(np.float64) for a, r0, r1 in ((qa, q0, q1), (ka, k0, k1), (va, k0, k1)))
        keep, p = _keep(drop, 1, qa.shape[1], int(q1 - q0), int(k1 - k0), int(q0), int(k0))
        out[q0:q1], lse[:, q0:q1] = (x[0] for x in _ref_forward(qf, kf, vf, scale, mask, sf, keep, p))
    return (out, lse) if return_lse else out


def reference_attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                        max_seqlen_k, *, causal=False, softmax_scale=None, deterministic=False,
                                        window=(-1, -1), softcap=0.0, sinks=None, dropout_p=0.0, dropout_rng=None):
    """``attention_varlen_backward`` in float64: (dq, dk, dv) of the packed documents, and dsinks
    (H,) with ``sinks``. ``out`` and ``lse`` are recomputed (given ones are shape-checked)."""
    qa, ka, va, cq, ck = _host_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                      _cfg.CONFIGS.bwd_head_dims, " by the backward")
    da = _arrays.as_host_array(dout, "dout")
    out_shape = (*qa.shape[:-1], va.shape[-1])
    _checks.like(da, qa, out_shape)
    if out is not None:
        _checks.like(_arrays.as_host_array(out, "out"), qa, out_shape)
    if lse is not None:
        la = _arrays.as_host_array(lse, "lse", ("float32",))
        if la.shape != (qa.shape[1], qa.shape[0]):
            raise ValueError(f"lse: shape {la.shape} does not match (heads, total_q) = {(qa.shape[1], qa.shape[0])}")
    scale = _scale(softmax_scale, qa.shape[-1])
    sf = _host_sinks(sinks, qa.shape[1])
    drop = _host_dropout(dropout_p, dropout_rng, softcap)
    grads = [np.zeros(qa.shape), np.zeros(ka.shape), np.zeros(va.shape)]
    dsinks = np.zeros(qa.shape[1])
    for i in range(len(cq) - 1):
        (q0, q1), (k0, k1) = cq[i:i + 2], ck[i:i + 2]
        mask = _attention_mask.mask_of(causal, window, softcap, int(q1 - q0), int(k1 - k0))
        dof, qf = (a.obj[None, q0:q1].astype(np.float64) for a in (da, qa))
        kf, vf = (a.obj[None, k0:k1].astype(np.float64) for a in (ka, va))
        keep, p = _keep(drop, 1, qa.shape[1], int(q1 - q0), int(k1 - k0), int(q0), int(k0))
        got = _ref_backward(dof, qf, kf, vf, scale, mask, sf, keep, p)
        for g, x, (r0, r1) in zip(grads, got, ((q0, q1), (k0, k1), (k0, k1))):
            g[r0:r1] = x[0]
        if sf is not None:
            dsinks += got[3]
    return tuple(grads) if sf is None else (*grads, dsinks)
