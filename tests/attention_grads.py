"""The scale of attention's gradients that rounding errors are proportional to (the tests of
test_attention and test_attention_mask compare against it)."""
from __future__ import annotations

import numpy as np

from cukern import _attention_mask


def gradient_scales(do, q, k, v, causal, softmax_scale, window=(-1, -1), softcap=0.0):
    """rms of dq, dk, dv computed with every cancelling sum replaced by a sum of magnitudes:
    the scale that a float32/bf16 evaluation's rounding errors are proportional to (dS =
    P (dP - rowsum(P dP)) cancels to zero for a query that sees one key)."""
    q, k, v, do = (np.asarray(a, np.float64) for a in (q, k, v, do))
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    scale = 1.0 / np.sqrt(D) if softmax_scale is None else softmax_scale
    rep = H // Hkv
    kh, vh = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
    mask = _attention_mask.mask_of(causal, window, softcap, Sq, Sk)
    s = _attention_mask.capped(np.einsum("bqhd,bkhd->bhqk", q, kh) * scale, mask)
    if mask.any:
        s = np.where(_attention_mask.visible(mask, Sq, Sk)[None, None], s, -np.inf)
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    p = np.exp(s - np.where(np.isfinite(m), m, 0.0))
    p = p / np.maximum(p.sum(axis=-1, keepdims=True), 1e-300)
    dp = np.einsum("bqhd,bkhd->bhqk", np.abs(do), np.abs(vh))
    ds = p * (dp + (p * dp).sum(axis=-1, keepdims=True))
    dq = np.einsum("bhqk,bkhd->bqhd", ds, np.abs(kh)) * scale
    dk = np.einsum("bhqk,bqhd->bkhd", ds, np.abs(q)) * scale
    dv = np.einsum("bhqk,bqhd->bkhd", p, np.abs(do))
    return [float(np.sqrt(np.mean(a * a))) if a.size else 0.0 for a in (dq, dk, dv)]
