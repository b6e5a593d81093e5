"""Sliding windows, the softcap and packed documents (varlen): the mask's arithmetic, the NumPy
references against torch float64 autograd, and argument checking (no GPU)."""
from __future__ import annotations

import dataclasses
import importlib

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from cukern import reference as ref

from arrays import torch
from attention_grads import gradient_scales

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


def _raw_visible(sq, sk, causal, window) -> np.ndarray:
    """flash-attn's documented bounds applied as written, with no normalization: query i sees
    keys i + sk - sq - left .. i + sk - sq + right (-1 unbounded), causal adds j <= i + sk - sq."""
    pos, j = np.arange(sq)[:, None] + sk - sq, np.arange(sk)[None, :]
    keep = np.ones((sq, sk), dtype=bool)
    left, right = window
    if causal:
        keep &= j <= pos
    if right >= 0:
        keep &= j <= pos + right
    if left >= 0:
        keep &= j >= pos - left
    return keep


@settings(max_examples=300, deadline=None)
@given(sq=st.integers(1, 12), sk=st.integers(1, 12), left=st.integers(-1, 14), right=st.integers(-1, 14),
       causal=st.booleans())
def test_mask_of_keeps_the_visible_keys(sq, sk, left, right, causal):
    """Normalizing never changes which keys a query sees: the documented bounds, applied raw."""
    np.testing.assert_array_equal(M.visible(M.mask_of(causal, (left, right), 0.0, sq, sk), sq, sk),
                                  _raw_visible(sq, sk, causal, (left, right)))


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
    s = s.masked_fill(~torch.from_numpy(_raw_visible(q.shape[1], k.shape[1], causal, window)), -float("inf"))
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
    # (atol: an lse near 0 carries the float64 rounding of its terms)
    np.testing.assert_allclose(lse[seen], lse_t.detach().numpy()[seen], rtol=1e-12, atol=1e-14)
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


def _packed(total_q=10, total_k=10, h=2, hkv=1, d=32, dtype=np.float16):
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
    (dict(softcap=3e38), ValueError, "softcap: .* outside float32's normal range"),   # (c log2(e) overflows)
    (dict(softcap=1e-37, softmax_scale=1e3), ValueError,
     r"softcap \(softmax_scale / softcap\): .* outside float32's normal range"),
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


def test_softcap_none_and_zero_both_mean_none():
    """One convention everywhere (the cross-entropy's too): None and 0 leave the scores as they are."""
    q, k, v = (a[None] for a in _packed())
    base = ref.attention(q, k, v, causal=True, return_lse=True)
    do = np.random.default_rng(4).standard_normal(q.shape).astype(q.dtype)
    grads = ref.attention_backward(do, q, k, v, causal=True)
    for cap in (None, 0.0, 0):
        got = ref.attention(q, k, v, causal=True, return_lse=True, softcap=cap)
        assert all(np.array_equal(a, b) for a, b in zip(got, base))
        assert all(np.array_equal(a, b) for a, b in zip(ref.attention_backward(do, q, k, v, causal=True, softcap=cap),
                                                        grads))
        assert M.mask_of(True, None, cap, 10, 10) == M.mask_of(True, None, 0.0, 10, 10)


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


# ---- the kernels against the references (GPU) ---------------------------------------------------

gpu = pytest.mark.gpu
FRAMEWORKS = ["cupy", "torch"] if torch is not None else ["cupy"]
TOL = {"float16": 4e-3, "bfloat16": 2e-2}   # (as test_attention's: P rounded to the dtype)


def _tol(dtype: str, softcap: float) -> float:
    """The dtype's tolerance, plus the softcap's: tanh.approx's 2^-11 relative error of a capped
    score (at most softcap in size) moves P by about softcap * 2^-11."""
    return TOL[dtype] + softcap * 2.0 ** -11


def _ints_to_device(a: np.ndarray, framework: str):
    if framework == "torch":
        return torch.from_numpy(a).cuda()
    import cupy

    return cupy.asarray(a)


def _check_out_lse(out, lse, e_out, e_lse, dtype, tol):
    from arrays import assert_close, to_host

    assert_close(out, e_out, dtype, "out", tol=tol, scale=0.25)
    got = to_host(lse)
    seen = np.isfinite(e_lse)
    assert np.array_equal(np.isinf(got) & (got > 0), ~seen), "lse must be +inf exactly where no key is seen"
    assert_close(got[seen], e_lse[seen], "float32", "lse", tol=1e-4 + tol / 10)


@st.composite
def mask_cases(draw):
    h, hkv = draw(st.sampled_from([(1, 1), (4, 2), (4, 1), (3, 3)]))
    sq, sk = draw(st.sampled_from([1, 17, 64, 129, 300])), draw(st.sampled_from([1, 17, 64, 100, 257, 300]))
    side = st.sampled_from([-1, 0, 1, 17, 64, 100, 400])
    return dict(b=draw(st.sampled_from([1, 2])), sq=sq, sk=sk, h=h, hkv=hkv,
                d=draw(st.sampled_from([32, 64, 96, 128, 256])), dtype=draw(st.sampled_from(list(TOL))),
                causal=draw(st.booleans()), window=(draw(side), draw(side)),
                softcap=draw(st.sampled_from([0.0, 0.0, 1.0, 5.0, 30.0])), scale=draw(st.sampled_from([None, 0.3])),
                framework=draw(st.sampled_from(FRAMEWORKS)), seed=draw(st.integers(0, 2**31 - 1)))


@gpu
@settings(max_examples=150, deadline=None)
@given(c=mask_cases())
def test_the_forward_with_windows_and_softcap_matches_the_reference(c):
    """Sliding windows on either side (narrower than a tile, across tiles, wider than the
    sequence; with causal), the softcap, GQA, rows that see no key; poisoned outputs."""
    import cukern
    from arrays import poison_allocator, random_host, to_device

    rng = np.random.default_rng(c["seed"])
    dt = c["dtype"]
    q = random_host(rng, (c["b"], c["sq"], c["h"], c["d"]), dt, scale=2.0)
    k = random_host(rng, (c["b"], c["sk"], c["hkv"], c["d"]), dt, scale=2.0)
    v = random_host(rng, (c["b"], c["sk"], c["hkv"], c["d"]), dt)
    poison_allocator(c["framework"], [q.nbytes, c["b"] * c["h"] * c["sq"] * 4])
    kw = dict(causal=c["causal"], softmax_scale=c["scale"], window=c["window"], softcap=c["softcap"])
    out, lse = cukern.attention(*(to_device(a, c["framework"]) for a in (q, k, v)), return_lse=True, **kw)
    e_out, e_lse = ref.attention(q, k, v, return_lse=True, **kw)
    _check_out_lse(out, lse, e_out, e_lse, dt, _tol(dt, c["softcap"]))


@st.composite
def varlen_cases(draw):
    docs = draw(documents())
    docs = [(lq * 23 % 97 if lq > 1 else lq, lk * 23 % 97 if lk > 1 else lk) for lq, lk in docs]   # (up to 96)
    h, hkv = draw(st.sampled_from([(2, 1), (4, 4), (3, 1)]))
    side = st.sampled_from([-1, 0, 5, 40])
    return dict(docs=docs, h=h, hkv=hkv, d=draw(st.sampled_from([64, 128])), dtype=draw(st.sampled_from(list(TOL))),
                causal=draw(st.booleans()), window=(draw(side), draw(side)), softcap=draw(st.sampled_from([0.0, 5.0])),
                slack=draw(st.sampled_from([0, 0, 7])), framework=draw(st.sampled_from(FRAMEWORKS)),
                seed=draw(st.integers(0, 2**31 - 1)))


def _packed_inputs(c, rng):
    from arrays import random_host

    cu_q = np.concatenate([[0], np.cumsum([d[0] for d in c["docs"]])]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum([d[1] for d in c["docs"]])]).astype(np.int32)
    q = random_host(rng, (int(cu_q[-1]), c["h"], c["d"]), c["dtype"], scale=2.0)
    k = random_host(rng, (int(cu_k[-1]), c["hkv"], c["d"]), c["dtype"], scale=2.0)
    v = random_host(rng, (int(cu_k[-1]), c["hkv"], c["d"]), c["dtype"])
    # (max_seqlen may exceed the longest document: the grid covers more rows than needed)
    max_q = max(d[0] for d in c["docs"]) + c["slack"]
    max_k = max(d[1] for d in c["docs"]) + c["slack"]
    return q, k, v, cu_q, cu_k, max(max_q, 1), max(max_k, 1)


@gpu
@settings(max_examples=120, deadline=None)
@given(c=varlen_cases())
def test_the_varlen_forward_matches_the_reference(c):
    """Packed documents (empty ones and single tokens among them, q and k lengths that differ)
    with every mask: each document attends to its own keys only; poisoned outputs."""
    import cukern
    from arrays import poison_allocator, to_device

    rng = np.random.default_rng(c["seed"])
    q, k, v, cu_q, cu_k, max_q, max_k = _packed_inputs(c, rng)
    fw = c["framework"]
    poison_allocator(fw, [q.nbytes, q.shape[0] * c["h"] * 4])
    kw = dict(causal=c["causal"], window=c["window"], softcap=c["softcap"])
    out, lse = cukern.attention_varlen(*(to_device(a, fw) for a in (q, k, v)), _ints_to_device(cu_q, fw),
                                       _ints_to_device(cu_k, fw), max_q, max_k, return_lse=True, **kw)
    e_out, e_lse = ref.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True, **kw)
    assert tuple(out.shape) == q.shape and tuple(lse.shape) == (c["h"], q.shape[0])
    if q.shape[0]:
        _check_out_lse(out, lse, e_out, e_lse, c["dtype"], _tol(c["dtype"], c["softcap"]))
    cukern.check_errors()   # (good offsets: no fault)


@gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("kw", [dict(causal=True), dict(), dict(window=(100, 3)), dict(causal=True, softcap=5.0)])
def test_long_documents_forward_and_backward(d, kw):
    """Documents of several query tiles and key blocks (the Hopper kernels' tiles of 64-128 rows
    and 128 keys), at odd offsets, with GQA: the forward and both dQ paths per document against
    the reference."""
    import cukern
    from arrays import poison_allocator, random_host, to_device

    docs = [(300, 300), (0, 5), (129, 257), (1, 1), (513, 200), (70, 0)]
    c = dict(docs=docs, h=4, hkv=2, d=d, dtype="bfloat16", slack=3)
    rng = np.random.default_rng(d)
    q, k, v, cu_q, cu_k, max_q, max_k = _packed_inputs(c, rng)
    do = random_host(rng, q.shape, "bfloat16")
    qd, kd, vd, dod = (to_device(a, "torch") for a in (q, k, v, do))
    cq, ck = _ints_to_device(cu_q, "torch"), _ints_to_device(cu_k, "torch")
    poison_allocator("torch", [q.nbytes, q.shape[0] * 4 * 4])
    out, lse = cukern.attention_varlen(qd, kd, vd, cq, ck, max_q, max_k, return_lse=True, **kw)
    e_out, e_lse = ref.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True, **kw)
    tol = _tol("bfloat16", kw.get("softcap", 0.0))
    _check_out_lse(out, lse, e_out, e_lse, "bfloat16", tol)
    expect = ref.attention_varlen_backward(do, q, k, v, None, None, cu_q, cu_k, max_q, max_k, **kw)
    for det in (False, True):
        grads = cukern.attention_varlen_backward(dod, qd, kd, vd, out, lse, cq, ck, max_q, max_k, deterministic=det,
                                                 **kw)
        _check_packed_gradients(grads, expect, (do, q, k, v), cu_q, cu_k, kw, "bfloat16", f"deterministic={det}")
    cukern.check_errors()


@gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_a_document_never_sees_its_neighbours_values(d, causal):
    """Documents are independent where a tile crosses into the next one (the Hopper kernels read
    whole tiles): Inf in one document's q, k, v and dout leaves the others' outputs and gradients
    finite and right, both dQ paths."""
    import cukern
    from arrays import assert_close, random_host, to_device, to_host

    docs = [(100, 100), (90, 90), (70, 70)]
    c = dict(docs=docs, h=2, hkv=1, d=d, dtype="float16", slack=0)
    rng = np.random.default_rng(d + causal)
    q, k, v, cu_q, cu_k, max_q, max_k = _packed_inputs(c, rng)
    do = random_host(rng, q.shape, "float16")
    for a in (q, k, v, do):
        a[100:190] = np.inf
    qd, kd, vd, dod = (to_device(a, "cupy") for a in (q, k, v, do))
    cq, ck = _ints_to_device(cu_q, "cupy"), _ints_to_device(cu_k, "cupy")
    out, lse = cukern.attention_varlen(qd, kd, vd, cq, ck, max_q, max_k, causal=causal, return_lse=True)
    for det in (False, True):
        grads = cukern.attention_varlen_backward(dod, qd, kd, vd, out, lse, cq, ck, max_q, max_k, causal=causal,
                                                 deterministic=det)
        for a, z in ((0, 100), (190, 260)):
            e_out, e_lse = ref.attention(q[None, a:z], k[None, a:z], v[None, a:z], causal=causal, return_lse=True)
            _check_out_lse(out[a:z][None], to_host(lse)[None, :, a:z], e_out, e_lse, "float16", TOL["float16"])
            expect = ref.attention_backward(do[None, a:z], q[None, a:z], k[None, a:z], v[None, a:z], causal=causal)
            for name, got, e in zip(("dq", "dk", "dv"), grads, expect):
                assert_close(got[a:z][None], e, "float16", f"{name} of tokens {a}:{z} (deterministic={det})",
                             tol=2 * TOL["float16"], scale=float(np.sqrt(np.mean(e * e))) + 0.1)
    cukern.check_errors()


@gpu
@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("cu_q, max_q, doc", [
    ([0, 6, 4, 10], 6, 1),    # decreasing
    ([0, 4, 10, 12], 6, 2),   # past the tokens
    ([0, 4, 10, 10], 5, 1),   # a document longer than max_seqlen_q
    ([2, 4, 10, 10], 6, 0),   # not from 0
])
def test_bad_offsets_are_reported_by_check_errors(cu_q, max_q, doc, framework):
    """Offsets are read on the device: a bad document is recorded (no sync, no out-of-bounds
    access) and raised by check_errors(); the good documents are still right."""
    import cukern
    from arrays import assert_close, to_device

    q, k, v = _packed(10, 10, 2, 1, 64)
    cq, ck = np.array(cu_q, np.int32), np.array([0, 4, 10, 10], np.int32)
    out = cukern.attention_varlen(*(to_device(a, framework) for a in (q, k, v)), _ints_to_device(cq, framework),
                                  _ints_to_device(ck, framework), max_q, 6)
    with pytest.raises(IndexError, match=f"cu_seqlens_q / cu_seqlens_k: document {doc} of 3 has offsets .* valid"):
        cukern.check_errors()
    cukern.check_errors()   # (cleared)
    if cu_q[:2] == [0, 4]:   # (document 0, tokens 0-3 of q and of k, is good)
        e = ref.attention(q[None, :4], k[None, :4], v[None, :4])[0]
        assert_close(out[:4], e, "float16", "out", tol=TOL["float16"])


# ---- the launch plans, no GPU (host arrays stand in for device arrays) -----------------------------

def _launch(info):
    (step,) = [s for s in info.value.plan.steps if isinstance(s, tuple) and s[0] == "launch"]
    return step


def test_the_forward_passes_the_window_and_softcap(host_arrays_as_device, monkeypatch):
    """The window and the softcap pick attention_fwd's MASK / SOFTCAP instance and reach its
    arguments (checked against the kernel's declared signature); Hopper's forward is kept for
    masks it has (none, causal, windows; the softcap too)."""
    import cukern
    from cukern import _kernels

    from conftest import DryRun

    q, kv = np.ones((2, 200, 4, 64), np.float16), np.ones((2, 300, 2, 64), np.float16)
    with pytest.raises(DryRun) as info:
        cukern.attention(q, kv, kv, causal=True, window=(50, 7), softcap=5.0, softmax_scale=0.25)
    _, inst, grid, _, args, _ = _launch(info)
    assert inst.name.startswith("attention_fwd<cuk::half, 64, ") and ", 2, true, " in inst.name
    assert (args["win_left"], args["win_right"]) == (50, 0) and grid == (2, 8)
    assert args["cap_in"] == pytest.approx(0.25 / 5.0) and args["cap_out"] == pytest.approx(5.0 * np.log2(np.e))
    assert args["cu_q"] == 0 and args["fault"] == 0   # (dense: null pointers)
    with pytest.raises(DryRun) as info:   # (a window too wide to hide a key: no mask at all)
        cukern.attention(q, kv, kv, window=(299, 199))
    assert ", 0, false, " in _launch(info)[1].name
    with pytest.raises(DryRun) as info:
        cukern.attention(q, kv, kv, window=(-1, 0))   # (the causal mask, as a window)
    assert ", 1, false, " in _launch(info)[1].name

    attn = importlib.import_module("cukern.attention")
    hopper_on = dataclasses.replace(attn.configs.CONFIGS, use_sm90=True)
    monkeypatch.setattr(_kernels, "compute_capability", lambda device: (9, 0))
    for kw, hopper in ((dict(causal=True), True), (dict(window=(-1, 0)), True), (dict(softcap=1.0), True),
                       (dict(window=(8, -1)), True)):
        with pytest.raises(DryRun) as info:
            attn._attention(q, kv, kv, kw.get("causal", False), None, False, hopper_on, kw.get("window", (-1, -1)),
                            kw.get("softcap", 0.0))
        _, inst, _, _, args, _ = _launch(info)
        assert inst.name.startswith("attention_fwd_sm90<" if hopper else "attention_fwd<"), kw
        # (T, D, DV, BN, STAGES, CONSUMERS, MASK, SOFTCAP, ...: the mask kind, the softcap flag and factors)
        template = inst.name[inst.name.index("<") + 1:-1].split(", ")
        assert template[6] == str(2 if "window" in kw and kw["window"][0] >= 0 else 1 if kw != dict(softcap=1.0)
                                  else 0)
        assert template[7] == ("true" if "softcap" in kw else "false")
        assert args["cap_out"] == (pytest.approx(np.log2(np.e)) if "softcap" in kw else 0.0)
        assert (args["win_left"], args["win_right"]) == ((8, -1) if kw == dict(window=(8, -1)) else (-1, 0) if
                                                         template[6] == "1" else (-1, -1))
    # (d128's persistent config with a window: static work tiles, no counter and no fill step)
    q128, kv128 = np.ones((2, 200, 4, 128), np.float16), np.ones((2, 300, 2, 128), np.float16)
    with pytest.raises(DryRun) as info:
        attn._attention(q128, kv128, kv128, True, None, False, hopper_on, (64, 0), 0.0)
    _, inst, grid, _, args, _ = _launch(info)
    assert inst.name.startswith("attention_fwd_sm90<cuk::half, 128, 128, 128, 3, 2, 2, false, ") and grid == (16, 1)
    assert args["tile_counter"] == 0 and len(info.value.plan.steps) == 1


def test_the_varlen_forward_plan(host_arrays_as_device, monkeypatch):
    """Packed documents: one launch over (max_seqlen_q row tiles, documents x heads), batch
    strides 0, Sq / Sk the token totals, the offsets and the fault record passed; lse (H, total_q)."""
    import cukern
    from cukern import _faults, _kernels

    from conftest import DryRun

    attn = importlib.import_module("cukern.attention")
    monkeypatch.setattr(_faults, "record", lambda device: np.zeros(3, np.int64))
    q, k, v = _packed(30, 40, 4, 2, 128)
    cu_q, cu_k = np.array([0, 10, 30], np.int32), np.array([0, 25, 40], np.int32)
    with pytest.raises(DryRun) as info:
        cukern.attention_varlen(q, k, v, cu_q, cu_k, 20, 25, causal=True, return_lse=True)
    _, inst, grid, _, args, slots = _launch(info)
    assert inst.name.startswith("attention_fwd<cuk::half, 128, ") and grid == (1, 8)
    assert (args["Sq"], args["Sk"], args["max_q"], args["max_k"], args["H"], args["Hkv"]) == (30, 40, 20, 25, 4, 2)
    assert args["q_sb"] == args["k_sb"] == args["o_sb"] == 0 and args["q_ss"] == 4 * 128 and args["k_ss"] == 2 * 128
    names = list(args)
    assert {names[i]: index for i, index, _ in slots if names[i].startswith("cu_")} == {"cu_q": 3, "cu_k": 4}
    assert args["fault"] != 0   # (the device's fault record)
    assert [a.shape for a in info.value.plan.allocs] == [(30, 4, 128), (4, 30)]
    # (Hopper: attention_fwd_sm90's VARLEN instance over the same grid, TMA boxes of one more
    # axis than the packed arrays, the offsets and the fault record)
    monkeypatch.setattr(_kernels, "compute_capability", lambda device: (9, 0))
    # (CUKERN_ATTENTION_SM80 or not)
    monkeypatch.setattr(attn.configs, "CONFIGS", dataclasses.replace(attn.configs.CONFIGS, use_sm90=True))
    attn._FWD_VARLEN.clear()   # (plans are kept by call signature, not by device)
    for kw, kind in ((dict(causal=True), 1), (dict(window=(7, 0), softcap=2.0), 2)):
        with pytest.raises(DryRun) as info:
            cukern.attention_varlen(q, k, v, cu_q, cu_k, 20, 25, return_lse=True, **kw)
        _, inst, grid, _, args, slots = _launch(info)
        cfg = attn.configs.CONFIGS.get("fwd_sm90_varlen", 128)
        assert inst.name == cfg.instance("float16", 128, kind, "softcap" in kw, varlen=True).name
        assert inst.name.endswith(", true, false>") and grid == (1, 8)
        assert (args["Sq"], args["Sk"], args["max_q"], args["max_k"], args["tiles"]) == (30, 40, 20, 25, 8)
        assert args["o_sb"] == 0 and args["o_ss"] == 4 * 128 and args["fault"] != 0
        maps = {list(args)[i]: (m.index, m.box) for i, m, _ in slots if isinstance(m, _kernels.MapSlot)}
        assert maps == {"q_map": (0, (1, cfg.block_rows, 1, 64)), "k_map": (1, (1, cfg.bn, 1, 64)),
                        "v_map": (2, (1, cfg.bn, 1, 64))}
        names = list(args)
        assert {names[i]: index for i, index, _ in slots if names[i].startswith("cu_")} == {"cu_q": 3, "cu_k": 4}
    monkeypatch.setattr(_kernels, "compute_capability", lambda device: (8, 0))
    with pytest.raises(ValueError, match="max_seqlen_q: 0, but q holds 30 tokens"):
        cukern.attention_varlen(q, k, v, cu_q, cu_k, 0, 25)
    with pytest.raises(ValueError, match="cu_seqlens_q: dtype int64"):
        cukern.attention_varlen(q, k, v, cu_q.astype(np.int64), cu_k, 20, 25)


def test_the_backward_plans(host_arrays_as_device, monkeypatch):
    """The backward with a window and the softcap: Dsum, then attention_bwd_dkdv (MASK 2,
    SOFTCAP) over key tiles, and dQ's conversion (or attention_bwd_dq, deterministic), each
    packed against its kernel's signature; packed documents: the offsets and a grid over the
    longest document; on Hopper, attention_bwd_sm90 takes the masks and the softcap."""

    import cukern
    from cukern import _faults, _kernels

    from conftest import DryRun

    monkeypatch.setattr(_faults, "record", lambda device: np.zeros(3, np.int64))
    q, kv = np.ones((2, 200, 4, 128), np.float16), np.ones((2, 300, 2, 128), np.float16)
    lse = np.ones((2, 4, 200), np.float32)
    with pytest.raises(DryRun) as info:
        cukern.attention_backward(q, q, kv, kv, q, lse, causal=True, window=(30, 0), softcap=2.0)
    launches = [s for s in info.value.plan.steps if isinstance(s, tuple) and s[0] == "launch"]
    assert [s[1].name.split("<")[0] for s in launches] == ["attention_bwd_dot", "attention_bwd_dkdv",
                                                          "attention_bwd_dq_convert"]
    _, inst, grid, _, args, _ = launches[1]
    assert ", 2, true, false, true, " in inst.name and grid == (3, 4)
    assert (args["win_left"], args["win_right"]) == (30, 0)
    with pytest.raises(DryRun) as info:
        cukern.attention_backward(q, q, kv, kv, q, lse, window=(30, 2), deterministic=True)
    launches = [s for s in info.value.plan.steps if isinstance(s, tuple) and s[0] == "launch"]
    assert launches[-1][1].name.startswith("attention_bwd_dq<") and ", 2, false, " in launches[-1][1].name
    # (packed documents)
    qp, kp, vp = _packed(30, 40, 4, 2, 128)
    cu_q, cu_k = np.array([0, 10, 30], np.int32), np.array([0, 25, 40], np.int32)
    with pytest.raises(DryRun) as info:
        cukern.attention_varlen_backward(qp, qp, kp, vp, qp, np.ones((4, 30), np.float32), cu_q, cu_k, 20, 25,
                                         causal=True, deterministic=True)
    launches = [s for s in info.value.plan.steps if isinstance(s, tuple) and s[0] == "launch"]
    dot, dkdv, dq = launches
    assert dot[4]["B"] == 1 and dot[4]["Sq"] == 30 and dot[4]["d_sb"] == 0
    assert dkdv[2] == (1, 4) and dq[2] == (1, 8)   # (25 keys in a 128-key tile; 20 queries in 64)
    for step in (dkdv, dq):
        names = list(step[4])
        assert {names[i]: index for i, index, _ in step[5] if names[i].startswith("cu_")} == {"cu_q": 6, "cu_k": 7}
        assert step[4]["max_q"] == 20 and step[4]["max_k"] == 25 and step[4]["Sq"] == 30 and step[4]["Sk"] == 40
    with pytest.raises(ValueError, match=r"lse: shape \(30, 4\) does not match \(heads, total_q\) = \(4, 30\)"):
        cukern.attention_varlen_backward(qp, qp, kp, vp, qp, np.ones((30, 4), np.float32), cu_q, cu_k, 20, 25)
    # (Hopper: the causal mask (with or without the softcap) and a window on attention_bwd_sm90)
    attn = importlib.import_module("cukern.attention")
    monkeypatch.setattr(_kernels, "compute_capability", lambda device: (9, 0))
    hopper_on = dataclasses.replace(attn.configs.CONFIGS, use_sm90_bwd=True)
    for kw, name in ((dict(), "attention_bwd_sm90<cuk::half, 128, 64, 2, 1, false, "),
                     (dict(window=(5, 0)), "attention_bwd_sm90<cuk::half, 128, 64, 2, 2, false, "),
                     (dict(softcap=3.0), "attention_bwd_sm90<cuk::half, 128, 64, 2, 1, true, ")):
        with pytest.raises(DryRun) as info:
            attn._attention_backward(q, q, kv, kv, q, lse, True, None, False, hopper_on, kw.get("window", (-1, -1)),
                                     kw.get("softcap", 0.0))
        assert [s[1].name for s in info.value.plan.steps if isinstance(s, tuple)][1].startswith(name), kw
    # (Hopper, packed documents: lse and Dsum as each document's query tiles, then the VARLEN
    # instance over (key blocks of the longest document, documents x kv heads), the dense
    # configs; with the softcap too)
    monkeypatch.setattr(attn.configs, "CONFIGS", hopper_on)
    attn._BWD_VARLEN.clear()
    with pytest.raises(DryRun) as info:
        cukern.attention_varlen_backward(qp, qp, kp, vp, qp, np.ones((4, 30), np.float32), cu_q, cu_k, 20, 25,
                                         causal=True)
    launches = [s for s in info.value.plan.steps if isinstance(s, tuple) and s[0] == "launch"]
    assert [s[1].name.split("<")[0] for s in launches] == ["attention_bwd_dot", "attention_bwd_rows_varlen",
                                                          "attention_bwd_sm90", "attention_bwd_dq_convert"]
    dot, rows, bwd, _ = launches
    cfg = hopper_on.get("bwd_sm90", 128)
    assert dot[4]["rows"] == 0 and rows[2] == (1, 8) and bwd[2] == (1, 4)
    assert bwd[1].name == cfg.instance("float16", 128, 1, False, varlen=True).name
    names = list(rows[4])
    (at,) = [index for i, index, _ in rows[5] if names[i] == "rows"]
    rows_alloc = info.value.plan.allocs[at - 8]   # (after the eight inputs)
    assert rows_alloc.shape == (1, 4, 1 + 2, 2, cfg.block_rows)   # (ceil(30 / 64) tiles + 2 documents)
    assert (bwd[4]["max_q"], bwd[4]["max_k"], bwd[4]["Sq"], bwd[4]["Sk"]) == (20, 25, 30, 40)
    attn._BWD_VARLEN.clear()
    with pytest.raises(DryRun) as info:
        cukern.attention_varlen_backward(qp, qp, kp, vp, qp, np.ones((4, 30), np.float32), cu_q, cu_k, 20, 25,
                                         softcap=5.0)
    launches = [s for s in info.value.plan.steps if isinstance(s, tuple) and s[0] == "launch"]
    cfg = hopper_on.get("bwd_sm90_softcap", 128)
    assert launches[2][1].name == cfg.instance("float16", 128, 0, False, True, varlen=True).name


def test_the_backward_fronts_return_their_allocated_gradients(host_arrays_as_device, monkeypatch):
    """The fronts pick dq, dk, dv out of the plan's buffer list (the given arrays, the offsets of
    packed documents, then the allocations): run with a fake plan that allocates and launches
    nothing, each gradient is its own allocation of its input's shape."""
    import cukern
    from cukern import _arrays, _faults, _plans

    def fake_run(self, arrays):
        for slot, fix in self.fixes:
            arrays[slot] = fix(arrays[slot])
        for n, alloc in enumerate(self.allocs):
            arrays.append(_arrays.wrap(np.full(alloc.shape, n, np.float32), f"alloc {n}"))
        return arrays

    monkeypatch.setattr(_plans.Plan, "__call__", fake_run)
    monkeypatch.setattr(_faults, "record", lambda device: np.zeros(3, np.int64))
    q, kv = np.ones((2, 20, 4, 64), np.float16), np.ones((2, 30, 2, 64), np.float16)
    dq, dk, dv = cukern.attention_backward(q, q, kv, kv, q, np.ones((2, 4, 20), np.float32), causal=True)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, kv.shape, kv.shape)
    assert (dq.flat[0], dk.flat[0], dv.flat[0]) == (0, 1, 2)
    qp, kp, vp = _packed(30, 40, 4, 2, 64)
    cu_q, cu_k = np.array([0, 10, 30], np.int32), np.array([0, 25, 40], np.int32)
    dq, dk, dv = cukern.attention_varlen_backward(qp, qp, kp, vp, qp, np.ones((4, 30), np.float32), cu_q, cu_k,
                                                  20, 25)
    assert (dq.shape, dk.shape, dv.shape) == (qp.shape, kp.shape, vp.shape)
    assert (dq.flat[0], dk.flat[0], dv.flat[0]) == (0, 1, 2)


@gpu
@settings(max_examples=100, deadline=None)
@given(c=mask_cases(), deterministic=st.booleans())
def test_the_backward_with_windows_and_softcap_matches_the_reference(c, deterministic):
    """dq, dk, dv with every mask and the softcap, both dQ paths; poisoned outputs; errors
    measured against the gradients' own scale (test_attention's)."""
    _backward_case(c, deterministic)


@gpu
@settings(max_examples=60, deadline=None)
@given(c=mask_cases(), sq=st.sampled_from([64, 129, 300]), sk=st.sampled_from([127, 129, 300, 513]),
       d=st.sampled_from([64, 128]), rows=st.sampled_from([64, 128]), producer=st.booleans(),
       deterministic=st.booleans(), sections=st.sampled_from([None, 1]))
def test_the_sm90_backward_with_windows_and_softcap(c, sq, sk, d, rows, producer, deterministic, sections):
    """The Hopper backward's walk over the query tiles a window leaves (several key blocks of
    128, query tiles of 64 and 128 rows, with and without the producer warpgroup) and its softcap;
    windows open to the left (the softcap's causal mask too) numbered in L2 sections of one
    (batch, kv head) group, or the default's."""

    from cukern import _kernels

    if _kernels.compute_capability(0) != (9, 0):
        pytest.skip("the Hopper path needs an sm_90 GPU")
    attn = importlib.import_module("cukern.attention")
    c.update(sq=sq, sk=sk, d=d)
    cfg = attn.Sm90BwdConfig(rows if d == 64 else 64, producer=producer)
    with pytest.MonkeyPatch.context() as mp:
        configs = dataclasses.replace(attn.configs.CONFIGS, bwd_sm90=((d, cfg),), bwd_sm90_softcap=((d, cfg),),
                                      use_sm90_bwd=True)
        if sections is not None:
            configs = dataclasses.replace(configs, bwd_l2_section_bytes=c["h"] // c["hkv"] * sq * d * 8)
        mp.setattr(attn.configs, "CONFIGS", configs)
        _backward_case(c, deterministic)


def _backward_case(c, deterministic):
    import cukern
    from arrays import assert_close, poison_allocator, random_host, to_device

    rng = np.random.default_rng(c["seed"])
    dt, fw = c["dtype"], c["framework"]
    q = random_host(rng, (c["b"], c["sq"], c["h"], c["d"]), dt, scale=2.0)
    k = random_host(rng, (c["b"], c["sk"], c["hkv"], c["d"]), dt, scale=2.0)
    v = random_host(rng, (c["b"], c["sk"], c["hkv"], c["d"]), dt)
    do = random_host(rng, q.shape, dt)
    kw = dict(causal=c["causal"], softmax_scale=c["scale"], window=c["window"], softcap=c["softcap"])
    qd, kd, vd, dod = (to_device(a, fw) for a in (q, k, v, do))
    out, lse = cukern.attention(qd, kd, vd, return_lse=True, **kw)
    poison_allocator(fw, [q.nbytes, k.nbytes, k.nbytes])
    grads = cukern.attention_backward(dod, qd, kd, vd, out, lse, deterministic=deterministic, **kw)
    expect = ref.attention_backward(do, q, k, v, **kw)
    scales = gradient_scales(do, q, k, v, c["causal"], c["scale"], c["window"], c["softcap"])
    for name, got, e, sc in zip(("dq", "dk", "dv"), grads, expect, scales):
        assert_close(got, e, dt, name, tol=2 * _tol(dt, c["softcap"]), scale=sc)


@gpu
@settings(max_examples=80, deadline=None)
@given(c=varlen_cases(), deterministic=st.booleans())
def test_the_varlen_backward_matches_the_reference(c, deterministic):
    """Packed documents' gradients: nothing crosses documents; keys of a document without
    queries get zero gradients; poisoned outputs."""
    import cukern
    from arrays import poison_allocator, random_host, to_device

    rng = np.random.default_rng(c["seed"])
    q, k, v, cu_q, cu_k, max_q, max_k = _packed_inputs(c, rng)
    do = random_host(rng, q.shape, c["dtype"])
    fw = c["framework"]
    kw = dict(causal=c["causal"], window=c["window"], softcap=c["softcap"])
    cq, ck = _ints_to_device(cu_q, fw), _ints_to_device(cu_k, fw)
    qd, kd, vd, dod = (to_device(a, fw) for a in (q, k, v, do))
    out, lse = cukern.attention_varlen(qd, kd, vd, cq, ck, max_q, max_k, return_lse=True, **kw)
    poison_allocator(fw, [q.nbytes, k.nbytes, k.nbytes])
    grads = cukern.attention_varlen_backward(dod, qd, kd, vd, out, lse, cq, ck, max_q, max_k,
                                             deterministic=deterministic, **kw)
    expect = ref.attention_varlen_backward(do, q, k, v, None, None, cu_q, cu_k, max_q, max_k, **kw)
    _check_packed_gradients(grads, expect, (do, q, k, v), cu_q, cu_k, kw, c["dtype"], f"deterministic={deterministic}")
    cukern.check_errors()


def _check_packed_gradients(grads, expect, host, cu_q, cu_k, kw, dtype, label):
    """Each document's dq, dk, dv against the reference, measured against that document's own
    gradient scales (test_attention's: where a few-key row's terms cancel); a document without
    queries has zero dk and dv, one without keys zero dq."""
    from arrays import assert_close, to_host

    do, q, k, v = host
    got = [to_host(g) for g in grads]
    tol = 2 * _tol(dtype, kw.get("softcap", 0.0))
    for (q0, q1), (k0, k1) in zip(zip(cu_q[:-1], cu_q[1:]), zip(cu_k[:-1], cu_k[1:])):
        if q1 == q0 or k1 == k0:
            assert not got[0][q0:q1].any() and not got[1][k0:k1].any() and not got[2][k0:k1].any(), \
                f"gradients of a document without queries or keys must be zero ({label})"
            continue
        scales = gradient_scales(do[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1],
                                 kw.get("causal", False), None, kw.get("window", (-1, -1)), kw.get("softcap", 0.0))
        for name, g, e, sc, (a, z) in zip(("dq", "dk", "dv"), got, expect, scales, ((q0, q1), (k0, k1), (k0, k1))):
            assert_close(g[a:z], e[a:z], dtype, f"{name} of document {q0}:{q1} ({label})", tol=tol, scale=sc)


# ---- cukern.torch: flash-attn's functions ------------------------------------------------------------

FLASH_ATTN_FUNC = ["q", "k", "v", "dropout_p", "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes",
                   "deterministic", "return_attn_probs"]
FLASH_ATTN_VARLEN_FUNC = ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dropout_p",
                          "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes", "deterministic",
                          "return_attn_probs", "block_table"]


@needs_torch
def test_flash_attn_functions_have_flash_attns_signatures():
    """flash-attn 2.6's parameter names, order and defaults, so that a call written for
    flash-attn runs unchanged, then FlashAttention-4's ``learnable_sink``; what cukern lacks
    (ALiBi, a paged KV cache, dropout where it is not taken) is refused by name before anything runs."""
    import inspect

    import cukern.torch as ct

    for fn, names in ((ct.flash_attn_func, FLASH_ATTN_FUNC), (ct.flash_attn_varlen_func, FLASH_ATTN_VARLEN_FUNC)):
        params = inspect.signature(fn).parameters
        assert list(params) == [*names, "learnable_sink"] and params["learnable_sink"].default is None
        defaults = {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}
        assert defaults["dropout_p"] == 0.0 and defaults["softmax_scale"] is None and defaults["causal"] is False
        assert defaults["window_size"] == (-1, -1) and defaults["softcap"] == 0.0 and defaults["alibi_slopes"] is None
        assert defaults["deterministic"] is False and defaults["return_attn_probs"] is False
    q = torch.zeros(1, 4, 2, 8)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    sink = torch.zeros(2)
    for call, pattern in ((lambda: ct.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 4, 4, dropout_p=0.1,
                                                             return_attn_probs=True),
                           "dropout_p: 0.1 with learnable_sink or return_attn_probs: not taken"),
                          (lambda: ct.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 4, 4, dropout_p=0.1,
                                                             softcap=5.0),
                           "dropout_p: 0.1 with softcap 5.0"),
                          (lambda: ct.flash_attn_func(q, q, q, dropout_p=0.1, learnable_sink=sink),
                           "dropout_p: 0.1 with learnable_sink or return_attn_probs: not taken"),
                          (lambda: ct.flash_attn_func(q, q, q, dropout_p=1.5), "dropout_p: must be a number in"),
                          (lambda: ct.flash_attn_func(q, q, q, alibi_slopes=q), "alibi_slopes: "),
                          (lambda: ct.flash_attn_varlen_func(q[0], q[0], q[0], cu, cu, 4, 4, block_table=cu),
                           "block_table: cukern's attention has no paged KV cache")):
        with pytest.raises(ValueError, match=pattern):
            call()


@gpu
@needs_torch
@pytest.mark.parametrize("compiled", [False, True])
def test_flash_attn_func_forward_and_gradients(compiled):
    """flash_attn_func (window, softcap, GQA, return_attn_probs, deterministic) and
    flash_attn_varlen_func under autograd, eager and torch.compile, against the references."""
    import cukern.torch as ct
    from arrays import assert_close

    g = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(2, 150, 4, 64, device="cuda", generator=g).to(torch.bfloat16).requires_grad_(True)
    k, v = (torch.randn(2, 170, 2, 64, device="cuda", generator=g).to(torch.bfloat16).requires_grad_(True)
            for _ in range(2))
    do = torch.randn(2, 150, 4, 64, device="cuda", generator=g).to(torch.bfloat16)
    fa = torch.compile(ct.flash_attn_func, fullgraph=True) if compiled else ct.flash_attn_func
    kw = dict(causal=True, window_size=(40, 0), softcap=20.0)
    out, lse, probs = fa(q, k, v, return_attn_probs=True, deterministic=True, **kw)
    assert probs is None and tuple(lse.shape) == (2, 4, 150)
    grads = torch.autograd.grad(out, (q, k, v), do)
    # (the references take half precision: bfloat16's values are float16's exactly at this range)
    host = [t.detach().float().cpu().numpy().astype(np.float16) for t in (q, k, v, do)]
    rkw = dict(causal=True, window=(40, 0), softcap=20.0)
    assert_close(out, ref.attention(*host[:3], **rkw), "bfloat16", "out", tol=_tol("bfloat16", 20.0), scale=0.25)
    for name, got, e in zip("qkv", grads, ref.attention_backward(host[3], *host[:3], **rkw)):
        assert_close(got, e, "bfloat16", f"d{name}", tol=2 * _tol("bfloat16", 20.0),
                     scale=float(np.sqrt(np.mean(e * e))))
    # packed documents
    cu = torch.tensor([0, 60, 61, 150], dtype=torch.int32, device="cuda")
    qp, kp, vp = (t[0, :150].detach().clone().requires_grad_(True) for t in (q, k, v))
    fv = torch.compile(ct.flash_attn_varlen_func, fullgraph=True) if compiled else ct.flash_attn_varlen_func
    outp = fv(qp, kp, vp, cu, cu, 89, 89, causal=True)
    gp = torch.autograd.grad(outp, (qp, kp, vp), do[0])
    hp = [t.detach().float().cpu().numpy().astype(np.float16) for t in (qp, kp, vp, do[0])]
    cuh = cu.cpu().numpy()
    assert_close(outp, ref.attention_varlen(*hp[:3], cuh, cuh, 89, 89, causal=True), "bfloat16", "out",
                 tol=TOL["bfloat16"], scale=0.25)
    expect = ref.attention_varlen_backward(hp[3], *hp[:3], None, None, cuh, cuh, 89, 89, causal=True)
    for name, got, e in zip("qkv", gp, expect):
        assert_close(got, e, "bfloat16", f"d{name}", tol=2 * TOL["bfloat16"], scale=float(np.sqrt(np.mean(e * e))))


@gpu
@pytest.mark.parametrize("sq, sk, h, hkv, window, causal", [
    (3, 200, 2, 1, (0, 0), False),        # (the key loop starts at an odd tile: buffer parity)
    (1000, 1100, 4, 2, (3, 5), False),    # (dK/dV's query walk from m_first > 0, GQA, a partial last tile)
    (300, 100, 2, 2, (10, -1), True),     # (rows that see no key: zeros, lse +inf, no gradient)
    (257, 257, 2, 1, (0, -1), True),      # (each query sees itself only)
])
def test_window_edge_cases_forward_and_both_backwards(sq, sk, h, hkv, window, causal):
    """Shapes chosen for the tile walks' edges; the two dQ paths agree with the reference."""
    import cukern
    from arrays import assert_close, random_host, to_device

    rng = np.random.default_rng(sq + sk)
    q = random_host(rng, (2, sq, h, 64), "float16", scale=2.0)
    k = random_host(rng, (2, sk, hkv, 64), "float16", scale=2.0)
    v, do = random_host(rng, (2, sk, hkv, 64), "float16"), random_host(rng, q.shape, "float16")
    kw = dict(causal=causal, window=window)
    qd, kd, vd, dod = (to_device(a, "cupy") for a in (q, k, v, do))
    out, lse = cukern.attention(qd, kd, vd, return_lse=True, **kw)
    e_out, e_lse = ref.attention(q, k, v, return_lse=True, **kw)
    _check_out_lse(out, lse, e_out, e_lse, "float16", TOL["float16"])
    expect = ref.attention_backward(do, q, k, v, **kw)
    scales = gradient_scales(do, q, k, v, causal, None, window)
    for det in (False, True):
        grads = cukern.attention_backward(dod, qd, kd, vd, out, lse, deterministic=det, **kw)
        for name, got, e, sc in zip(("dq", "dk", "dv"), grads, expect, scales):
            assert_close(got, e, "float16", f"{name} (deterministic={det})", tol=2 * TOL["float16"], scale=sc)
