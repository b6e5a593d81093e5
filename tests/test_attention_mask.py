"""Sliding windows, the softcap and packed documents (varlen): the mask's arithmetic, the NumPy
references against torch float64 autograd, and argument checking (no GPU)."""
from __future__ import annotations

import importlib

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from cukern import reference as ref

from arrays import torch

M = importlib.import_module("cukern._attention_mask")
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")


def test_mask_of_normalizes_the_window():
    """causal sets the right side to 0 (as flash-attn); a side too wide to hide a key is
    unbounded (left >= sk - 1, right >= sq - 1); None and (-1, -1) are no window."""
    assert M.mask_of(False, None, 0.0, 10, 10) == M.Mask() == M.mask_of(False, (-1, -1), 0, 10, 10)
    assert M.mask_of(True, (-1, -1), 0.0, 10, 10) == M.Mask(-1, 0) and M.Mask(-1, 0).causal
    assert M.mask_of(True, (3, 5), 0.0, 10, 10) == M.Mask(3, 0) and not M.Mask(3, 0).causal
    assert M.mask_of(False, (9, 9), 0.0, 10, 10) == M.Mask() and M.mask_of(False, (8, 8), 0, 10, 10) == M.Mask(8, 8)
    # (more queries than keys: row 0's bound is right - (sq - sk), so right = 1 still hides keys)
    assert M.mask_of(False, (0, 1), 0.0, 3, 1) == M.Mask(-1, 1)
    assert M.mask_of(True, None, 0.0, 1, 7) == M.Mask()   # (one query, at the end: sees every key)
    assert M.mask_of(False, (0, 0), 2.5, 10, 10) == M.Mask(0, 0, 2.5)
    assert M.Mask(3, 0).windowed and M.Mask(-1, 2).windowed and not M.Mask(-1, 0).windowed
    assert not M.Mask().any and M.Mask(-1, 0).any and M.Mask(4, -1).any


@settings(max_examples=300, deadline=None)
@given(sq=st.integers(1, 12), sk=st.integers(1, 12), left=st.integers(-1, 14), right=st.integers(-1, 14),
       causal=st.booleans())
def test_mask_of_keeps_the_visible_keys(sq, sk, left, right, causal):
    """Normalizing never changes which keys a query sees: the documented bounds, applied raw."""
    pos, j = np.arange(sq)[:, None] + sk - sq, np.arange(sk)[None, :]
    raw = np.ones((sq, sk), dtype=bool)
    if causal:
        raw &= j <= pos
    if right >= 0:
        raw &= j <= pos + right
    if left >= 0:
        raw &= j >= pos - left
    np.testing.assert_array_equal(M.visible(M.mask_of(causal, (left, right), 0.0, sq, sk), sq, sk), raw)


@settings(max_examples=300, deadline=None)
@given(sq=st.integers(1, 40), sk=st.integers(1, 40), left=st.integers(-1, 45), right=st.integers(-1, 45),
       row0=st.integers(0, 39), rows=st.integers(1, 16))
def test_key_range_is_the_span_of_the_visible_keys(sq, sk, left, right, row0, rows):
    """What the kernels skip by: the keys [first, stop) that key_range gives for a block of rows
    hold every key a row of the block sees, and start and end with one that some row sees."""
    row0 = min(row0, sq - 1)
    mask = M.mask_of(False, (left, right), 0.0, sq, sk)
    seen = M.visible(mask, sq, sk)[row0:row0 + rows].any(axis=0)
    first, stop = M.key_range(mask, row0, rows, sq, sk)
    if not seen.any():
        assert first >= stop or not seen[max(first, 0):max(stop, 0)].any()
    else:
        keys = np.flatnonzero(seen)
        assert (first, stop) == (keys[0], keys[-1] + 1)


def _torch_attention(q, k, v, scale, causal, window, softcap):
    """An independent float64 implementation: torch autograd over an explicit mask."""
    qt, kt, vt = (torch.tensor(a, dtype=torch.float64, requires_grad=True) for a in (q, k, v))
    rep = q.shape[2] // k.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", qt, kt.repeat_interleave(rep, 2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    sq, sk = q.shape[1], k.shape[1]
    pos, j = torch.arange(sq)[:, None] + sk - sq, torch.arange(sk)[None, :]
    keep = torch.ones(sq, sk, dtype=torch.bool)
    left, right = window
    if causal:
        keep &= j <= pos
    if right >= 0:
        keep &= j <= pos + right
    if left >= 0:
        keep &= j >= pos - left
    s = s.masked_fill(~keep, -float("inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)   # (rows that see no key: zeros)
    out = torch.einsum("bhqk,bkhd->bqhd", p, vt.repeat_interleave(rep, 2))
    return out, lse, (qt, kt, vt)


windows = st.tuples(st.integers(-1, 12), st.integers(-1, 12))


@needs_torch
@settings(max_examples=120, deadline=None)
@given(sq=st.integers(1, 20), sk=st.integers(1, 20), heads=st.sampled_from([(1, 1), (4, 2), (3, 1), (2, 2)]),
       causal=st.booleans(), window=windows, softcap=st.sampled_from([0.0, 0.7, 5.0]), seed=st.integers(0, 99))
def test_references_match_torch_autograd(sq, sk, heads, causal, window, softcap, seed):
    """Forward (out, lse) and backward of every mask: causal, windows on either side (wider than
    the keys too), the softcap, GQA, rows that see no key (zeros, lse = +inf, no gradient)."""
    rng = np.random.default_rng(seed)
    h, hkv = heads
    q = rng.standard_normal((2, sq, h, 8)) * 2
    k, v = rng.standard_normal((2, sk, hkv, 8)) * 2, rng.standard_normal((2, sk, hkv, 8))
    dout = rng.standard_normal(q.shape)
    kw = dict(causal=causal, softmax_scale=0.6, window=window, softcap=softcap)
    out, lse = ref.attention(q, k, v, return_lse=True, **kw)
    o_t, lse_t, leaves = _torch_attention(q, k, v, 0.6, causal, window, softcap)
    np.testing.assert_allclose(out, o_t.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(lse_t.detach().numpy()))
    seen = np.isfinite(lse)
    np.testing.assert_allclose(lse[seen], lse_t.detach().numpy()[seen], rtol=1e-12)
    assert (lse[~seen] == np.inf).all()
    o_t.backward(torch.tensor(dout))
    grads = ref.attention_backward(dout, q, k, v, out, lse.astype(np.float32), **kw)
    for name, g, t in zip("qkv", grads, leaves):
        np.testing.assert_allclose(g, t.grad.numpy(), rtol=1e-9, atol=1e-11, err_msg=f"d{name}")


@st.composite
def documents(draw):
    """Per document (q tokens, k tokens): empty documents and single tokens among them."""
    n = draw(st.integers(1, 5))
    lengths = st.one_of(st.just(0), st.just(1), st.integers(0, 14))
    same = draw(st.booleans())
    docs = []
    for _ in range(n):
        lq = draw(lengths)
        docs.append((lq, lq if same else draw(lengths)))
    return docs


@settings(max_examples=80, deadline=None)
@given(docs=documents(), causal=st.booleans(), window=windows, softcap=st.sampled_from([0.0, 1.5]),
       heads=st.sampled_from([(2, 1), (2, 2)]), seed=st.integers(0, 99))
def test_varlen_reference_is_the_dense_one_per_document(docs, causal, window, softcap, heads, seed):
    """Each document of the packed form is the dense attention of its own tokens (its mask
    aligned to its own bottom right): nothing crosses documents, forward or backward."""
    rng = np.random.default_rng(seed)
    h, hkv = heads
    cu_q = np.concatenate([[0], np.cumsum([d[0] for d in docs])]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum([d[1] for d in docs])]).astype(np.int32)
    q = rng.standard_normal((int(cu_q[-1]), h, 8))
    k, v = rng.standard_normal((int(cu_k[-1]), hkv, 8)), rng.standard_normal((int(cu_k[-1]), hkv, 8))
    dout = rng.standard_normal(q.shape)
    max_q, max_k = max(d[0] for d in docs), max(d[1] for d in docs)
    kw = dict(causal=causal, window=window, softcap=softcap)
    out, lse = ref.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True, **kw)
    dq, dk, dv = ref.attention_varlen_backward(dout, q, k, v, out, lse.astype(np.float32), cu_q, cu_k, max_q, max_k,
                                               **kw)
    assert out.shape == q.shape and lse.shape == (h, q.shape[0]) and dk.shape == k.shape
    for i in range(len(docs)):
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        if docs[i][0] == 0:
            continue
        if docs[i][1] == 0:   # (no keys: zeros, lse = +inf)
            assert (out[qs] == 0).all() and (lse[:, qs] == np.inf).all() and (dq[qs] == 0).all()
            continue
        o1, l1 = ref.attention(q[None, qs], k[None, ks], v[None, ks], return_lse=True, **kw)
        g1 = ref.attention_backward(dout[None, qs], q[None, qs], k[None, ks], v[None, ks], **kw)
        np.testing.assert_array_equal(out[qs], o1[0])
        np.testing.assert_array_equal(lse[:, qs], l1[0])
        for g, x, rows in zip((dq, dk, dv), g1, (qs, ks, ks)):
            np.testing.assert_array_equal(g[rows], x[0])
    for i in range(len(docs)):   # (keys of a document without queries get no gradient)
        if docs[i][0] == 0:
            ks = slice(cu_k[i], cu_k[i + 1])
            assert (dk[ks] == 0).all() and (dv[ks] == 0).all()


def _packed(total_q=10, total_k=10, h=2, hkv=1, d=8, dtype=np.float16):
    rng = np.random.default_rng(3)
    return (rng.standard_normal((total_q, h, d)).astype(dtype), rng.standard_normal((total_k, hkv, d)).astype(dtype),
            rng.standard_normal((total_k, hkv, d)).astype(dtype))


@pytest.mark.parametrize("kwargs, exc, pattern", [
    (dict(window=(1,)), TypeError, r"window: expected \(left, right\)"),
    (dict(window=5), TypeError, r"window: expected \(left, right\)"),
    (dict(window=(-2, 0)), ValueError, r"window\[0\]: must be >= -1"),
    (dict(window=(0, -3)), ValueError, r"window\[1\]: must be >= -1"),
    (dict(window=(1.0, 2)), TypeError, r"window\[0\]: expected an int, got float"),
    (dict(softcap=-1.0), ValueError, "softcap: must be finite and non-negative"),
    (dict(softcap=float("inf")), ValueError, "softcap: must be finite and non-negative"),
    (dict(softcap=1e-45), ValueError, "softcap: .* outside float32's normal range"),
    (dict(softcap="1"), TypeError, "softcap: expected a number, got str"),
])
def test_bad_window_and_softcap(kwargs, exc, pattern):
    q, k, v = (a[None] for a in _packed())
    with pytest.raises(exc, match=pattern):
        ref.attention(q, k, v, **kwargs)
    with pytest.raises(exc, match=pattern):
        ref.attention_backward(q, q, k, v, **kwargs)
    cu = np.array([0, 4, 10], np.int32)
    with pytest.raises(exc, match=pattern):
        ref.attention_varlen(q[0], k[0], v[0], cu, cu, 6, 6, **kwargs)


CU = np.array([0, 4, 10], np.int32)


@pytest.mark.parametrize("args, exc, pattern", [
    ((CU.astype(np.int64), CU, 6, 6), ValueError, "cu_seqlens_q: dtype int64"),
    ((CU, CU.astype(np.float32), 6, 6), ValueError, "cu_seqlens_k: dtype float32"),
    ((CU[None], CU, 6, 6), ValueError, r"cu_seqlens_q: expected \(batch \+ 1,\) offsets"),
    ((CU[:1], CU[:1], 6, 6), ValueError, r"cu_seqlens_q: expected \(batch \+ 1,\) offsets"),
    ((CU, CU[:2], 6, 6), ValueError, "cu_seqlens_k: 1 documents, cu_seqlens_q 2"),
    ((np.array([1, 4, 10], np.int32), CU, 6, 6), ValueError, "cu_seqlens_q: must start at 0, got 1"),
    ((CU, np.array([0, 7, 10], np.int32), 6, 6), ValueError, "cu_seqlens_k: document 0 has 7 tokens, more than"),
    ((np.array([0, 6, 4], np.int32), CU, 6, 6), ValueError, "cu_seqlens_q: offsets must not decrease, got 6 then 4"),
    ((np.array([0, 4, 11], np.int32), CU, 7, 6), ValueError, "the last offset 11 must be the token count 10"),
    ((np.array([0, 4, 9], np.int32), CU, 6, 6), ValueError, "cu_seqlens_q: the last offset 9 must be the token"),
    ((CU, CU, 5, 6), ValueError, "cu_seqlens_q: document 1 has 6 tokens, more than max_seqlen 5"),
    ((CU, CU, 6, -1), ValueError, "max_seqlen_k: must be >= 0, got -1"),
    ((CU, CU, 6.0, 6), TypeError, "max_seqlen_q: expected an int, got float"),
])
def test_bad_cu_seqlens(args, exc, pattern):
    q, k, v = _packed()
    with pytest.raises(exc, match=pattern):
        ref.attention_varlen(q, k, v, *args)
    with pytest.raises(exc, match=pattern):
        ref.attention_varlen_backward(q, q, k, v, None, None, *args)


@pytest.mark.parametrize("shapes, pattern", [
    (((10, 2, 8), (1, 10, 1, 8), (1, 10, 1, 8)), r"k: expected \(total_tokens, heads, head_dim\)"),
    (((10, 3, 8), (10, 2, 8), (10, 2, 8)), "k: 2 kv heads do not divide q's 3 heads"),
    (((10, 2, 8), (10, 1, 16), (10, 1, 16)), "k: head_dim 16 does not match q's 8"),
    (((10, 2, 8), (10, 1, 8), (9, 1, 8)), r"v: shape \(9, 1, 8\) does not match k's \(10, 1, 8\)"),
])
def test_bad_packed_shapes(shapes, pattern):
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(s).astype(np.float16) for s in shapes)
    with pytest.raises(ValueError, match=pattern):
        ref.attention_varlen(q, k, v, CU, CU, 6, 6)
