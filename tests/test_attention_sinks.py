"""Attention sinks (``sinks=``; flash-attn's ``learnable_sink``): a logit per query head that joins
every row's softmax denominator and carries no value (GPT-OSS). The NumPy reference against
PyTorch's autograd of the eager form GPT-OSS runs (the sink a column of the scores), the argument
checks on the CPU, and on the GPU both kernel paths, forward and backward (the sinks' gradient
too), dense and packed, through CuPy and through ``cukern.torch``."""
from __future__ import annotations

import dataclasses
import importlib

import numpy as np
import pytest

import cukern
from cukern import reference as ref

from arrays import assert_close, poison_allocator, random_host, to_device, to_host, torch
from attention_grads import gradient_scales

gpu = pytest.mark.gpu
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")
attn = importlib.import_module("cukern.attention")
M = importlib.import_module("cukern._attention_mask")

TOL = {"float16": 4e-3, "bfloat16": 2e-2}


def _torch_sinks(q, k, v, sinks, causal, scale, window=(-1, -1), softcap=0.0):
    """float64 on the CPU: GPT-OSS's eager attention (scores, the mask, the sink as one more column
    of the softmax, dropped after), with PyTorch's autograd; the lse over the scores and the sink."""
    qt, kt, vt = (torch.tensor(a).transpose(1, 2).requires_grad_(True) for a in (q, k, v))
    st = torch.tensor(sinks, dtype=torch.float64, requires_grad=True)
    rep = qt.shape[1] // kt.shape[1]
    kk, vv = kt.repeat_interleave(rep, 1), vt.repeat_interleave(rep, 1)
    sq, sk = qt.shape[2], kk.shape[2]
    s = (qt @ kk.transpose(-1, -2)) * scale
    mask = M.mask_of(causal, window, softcap, sq, sk)
    if mask.softcap:
        s = mask.softcap * torch.tanh(s / mask.softcap)
    s = s.masked_fill(~torch.as_tensor(M.visible(mask, sq, sk)), -float("inf"))
    full = torch.cat([s, st.reshape(1, -1, 1, 1).expand(s.shape[0], -1, sq, 1)], dim=-1)
    out = (torch.softmax(full, -1)[..., :-1] @ vv).transpose(1, 2)
    return out, torch.logsumexp(full, -1), (qt, kt, vt, st)


def _host_case(rng, b, sq, sk, h, hkv, d, dtype="float64"):
    q = rng.standard_normal((b, sq, h, d))
    k, v = rng.standard_normal((b, sk, hkv, d)), rng.standard_normal((b, sk, hkv, d))
    sinks = rng.standard_normal(h) * 2
    sinks[0] = 6.0   # (a sink above every score: the row's maximum is the sink's)
    return q, k, v, sinks


@needs_torch
@pytest.mark.parametrize("causal, window, softcap", [(False, (-1, -1), 0.0), (True, (-1, -1), 0.0),
                                                     (False, (3, 1), 0.0), (True, (-1, -1), 2.5)])
@pytest.mark.parametrize("sq, sk, h, hkv", [(5, 7, 4, 2), (9, 4, 2, 2), (1, 13, 2, 1)])
def test_reference_with_sinks_matches_the_concatenated_softmax(sq, sk, h, hkv, causal, window, softcap):
    """Forward (out, lse) and backward (dq, dk, dv, dsinks) in float64, against PyTorch's autograd;
    causal with Sq > Sk has rows that see no key (zeros, lse = the sink)."""
    rng = np.random.default_rng(sq * 100 + sk + h)
    q, k, v, sinks = _host_case(rng, 2, sq, sk, h, hkv, 8)
    do = rng.standard_normal(q.shape)
    kw = dict(causal=causal, softmax_scale=0.4, window=window, softcap=softcap)
    out, lse = ref.attention(q, k, v, return_lse=True, sinks=sinks, **kw)
    o_t, lse_t, leaves = _torch_sinks(q, k, v, sinks, causal, 0.4, window, softcap)
    np.testing.assert_allclose(out, o_t.detach().numpy(), rtol=1e-11, atol=1e-12)
    np.testing.assert_allclose(lse, lse_t.detach().numpy(), rtol=1e-11, atol=1e-12)
    o_t.backward(torch.tensor(do))
    grads = ref.attention_backward(do, q, k, v, sinks=sinks, **kw)
    assert len(grads) == 4
    for name, got, t in zip(("dq", "dk", "dv", "dsinks"), grads, leaves):
        expect = t.grad.numpy()
        np.testing.assert_allclose(got, expect.transpose(0, 2, 1, 3) if t.ndim == 4 else expect, rtol=1e-9,
                                   atol=1e-11, err_msg=name)


def test_reference_sinks_of_minus_infinity_are_no_sinks():
    rng = np.random.default_rng(3)
    q, k, v, _ = _host_case(rng, 2, 6, 6, 2, 1, 8)
    none = np.full(2, -np.inf)
    out, lse = ref.attention(q, k, v, causal=True, return_lse=True, sinks=none)
    out0, lse0 = ref.attention(q, k, v, causal=True, return_lse=True)
    np.testing.assert_array_equal(out, out0)
    np.testing.assert_array_equal(lse, lse0)
    do = rng.standard_normal(q.shape)
    *grads, dsinks = ref.attention_backward(do, q, k, v, causal=True, sinks=none)
    for g, g0 in zip(grads, ref.attention_backward(do, q, k, v, causal=True)):
        np.testing.assert_array_equal(g, g0)
    np.testing.assert_array_equal(dsinks, 0.0)


def test_a_row_without_keys_gives_zeros_and_the_sinks_lse():
    rng = np.random.default_rng(4)
    q, k, v, sinks = _host_case(rng, 1, 6, 2, 2, 2, 8)
    out, lse = ref.attention(q, k, v, causal=True, return_lse=True, sinks=sinks)
    assert np.all(out[0, :4] == 0)
    np.testing.assert_array_equal(lse[0, :, :4], np.broadcast_to(sinks[:, None], (2, 4)))


def test_packed_reference_with_sinks_is_the_dense_one_per_document():
    rng = np.random.default_rng(5)
    lengths = [5, 0, 9, 3]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    q, k, v, sinks = _host_case(rng, 1, cu[-1], cu[-1], 4, 2, 8)
    q, k, v = q[0], k[0], v[0]
    do = rng.standard_normal(q.shape)
    out, lse = ref.attention_varlen(q, k, v, cu, cu, 9, 9, causal=True, return_lse=True, sinks=sinks)
    *grads, dsinks = ref.attention_varlen_backward(do, q, k, v, None, None, cu, cu, 9, 9, causal=True, sinks=sinks)
    total = np.zeros(4)
    for i in range(len(lengths)):
        a, b = cu[i], cu[i + 1]
        if a == b:
            continue
        o, l_ = ref.attention(q[None, a:b], k[None, a:b], v[None, a:b], causal=True, return_lse=True, sinks=sinks)
        np.testing.assert_allclose(out[a:b], o[0], rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(lse[:, a:b], l_[0], rtol=1e-12, atol=1e-13)
        *g, ds = ref.attention_backward(do[None, a:b], q[None, a:b], k[None, a:b], v[None, a:b], causal=True,
                                        sinks=sinks)
        for got, e in zip(grads, g):
            np.testing.assert_allclose(got[a:b], e[0], rtol=1e-12, atol=1e-13)
        total += ds
    np.testing.assert_allclose(dsinks, total, rtol=1e-12, atol=1e-13)


def test_sinks_argument_checks_without_a_gpu(host_arrays_as_device):
    """The sinks' checks, forward and backward, dense and packed, before anything launches; a
    valid call builds its plan (packing the kernels' arguments, the sinks among them)."""
    from conftest import DryRun

    q = np.ones((2, 8, 4, 64), np.float16)
    kv = np.ones((2, 8, 2, 64), np.float16)
    lse = np.zeros((2, 4, 8), np.float32)
    good = np.zeros(4, np.float32)
    for sinks, exc, pattern in ((np.zeros(2, np.float32), ValueError, r"^sinks: shape \(2,\); expected \(heads,\)"),
                                (np.zeros((4, 1), np.float32), ValueError, r"^sinks: shape \(4, 1\)"),
                                (np.zeros(4, np.float16), ValueError, "^sinks: dtype float16 is not supported"),
                                ([0.0] * 4, TypeError, "^sinks: ")):
        with pytest.raises(exc, match=pattern):
            cukern.attention(q, kv, kv, sinks=sinks)
        with pytest.raises(exc, match=pattern):
            cukern.attention_backward(q, q, kv, kv, q, lse, sinks=sinks)
        with pytest.raises(exc, match=pattern):
            cukern.attention_varlen(q[0], kv[0], kv[0], np.array([0, 8], np.int32), np.array([0, 8], np.int32), 8, 8,
                                    sinks=sinks)
    for call in (lambda: cukern.attention(q, kv, kv, sinks=good),
                 lambda: cukern.attention(q, kv[:, :0], kv[:, :0], sinks=good),   # (no keys: the kernel writes lse)
                 lambda: cukern.attention_backward(q, q, kv, kv, q, lse, sinks=good),
                 lambda: cukern.attention_backward(q, q, kv, kv, q, lse, sinks=good[::-1])):   # (copied contiguous)
        with pytest.raises(DryRun) as e:
            call()
        launches = [st for st in e.value.plan.steps if isinstance(st, tuple) and st[0] == "launch"]
        assert launches, "no launch"
        assert all("sinks" in st[4] for st in launches if st[1].name.startswith("attention_fwd"))
    # (the sinks' gradient has its own launch, after the correction's)
    with pytest.raises(DryRun) as e:
        cukern.attention_backward(q, q, kv, kv, q, lse, sinks=good)
    names = [st[1].name for st in e.value.plan.steps if isinstance(st, tuple) and st[0] == "launch"]
    assert names.index("attention_bwd_sink") == names.index(next(n for n in names if "attention_bwd_dot" in n)) + 1


# ---- on the GPU ---------------------------------------------------------------------------------

def _configs(hopper: bool):
    shipped = attn.configs.CONFIGS
    return dataclasses.replace(shipped, use_sm90=hopper and shipped.use_sm90,
                               use_sm90_bwd=hopper and shipped.use_sm90_bwd)


CASES = [  # (b, sq, sk, h, hkv, d, causal, window, softcap)
    (2, 128, 128, 4, 2, 64, True, (-1, -1), 0.0),
    (1, 200, 333, 4, 4, 128, False, (-1, -1), 0.0),
    (2, 96, 160, 6, 2, 128, False, (32, 16), 0.0),
    (1, 150, 70, 2, 1, 64, True, (-1, -1), 0.0),    # Sq > Sk: rows with no key (the sink's lse)
    (1, 130, 130, 4, 1, 128, True, (-1, -1), 30.0),
    (1, 64, 96, 2, 2, 256, False, (-1, -1), 0.0),
    (1, 40, 0, 2, 2, 64, False, (-1, -1), 0.0),     # no keys at all
]


@gpu
@pytest.mark.parametrize("hopper", [True, False], ids=["default-path", "sm80-path"])
@pytest.mark.parametrize("dtype, framework, deterministic", [("bfloat16", "cupy", False), ("float16", "torch", True),
                                                             ("bfloat16", "torch", True)])
@pytest.mark.parametrize("case", CASES, ids=[f"c{i}" for i in range(len(CASES))])
def test_sinks_forward_and_backward_match_the_reference(case, dtype, framework, deterministic, hopper, monkeypatch):
    b, sq, sk, h, hkv, d, causal, window, softcap = case
    monkeypatch.setattr(attn.configs, "CONFIGS", _configs(hopper))
    rng = np.random.default_rng(sq + sk + d)
    q = random_host(rng, (b, sq, h, d), dtype)
    k, v = random_host(rng, (b, sk, hkv, d), dtype), random_host(rng, (b, sk, hkv, d), dtype)
    do = random_host(rng, q.shape, dtype)
    sinks = (rng.standard_normal(h) * 2).astype(np.float32)
    sinks[0] = 6.0
    kw = dict(causal=causal, window=window, softcap=softcap)
    qd, kd, vd, dod, sd = (to_device(a, framework) for a in (q, k, v, do, sinks))
    poison_allocator(framework, [q.nbytes, b * h * sq * 4])
    out, lse = cukern.attention(qd, kd, vd, return_lse=True, sinks=sd, **kw)
    e_out, e_lse = ref.attention(q, k, v, return_lse=True, sinks=sinks, **kw)
    assert_close(out, e_out, dtype, "out", tol=TOL[dtype])
    assert_close(lse, e_lse, "float32", "lse", tol=1e-4, scale=1.0)
    poison_allocator(framework, [q.nbytes, k.nbytes, k.nbytes, h * 4])
    grads = cukern.attention_backward(dod, qd, kd, vd, out, lse, sinks=sd, deterministic=deterministic, **kw)
    expect = ref.attention_backward(do, q, k, v, sinks=sinks, **kw)
    scales = gradient_scales(do, q, k, v, causal, None, window, softcap)
    assert len(grads) == 4
    for name, got, e, sc in zip(("dq", "dk", "dv"), grads[:3], expect[:3], scales):
        assert_close(got, e, dtype, name, tol=2 * TOL[dtype], scale=sc)
    # dsinks = -sum_rows P_sink (dO . O): its rounding follows O's, measured against the sum of
    # the terms' magnitudes
    assert tuple(grads[3].shape) == (h,)
    p_sink = np.where(np.isfinite(e_lse), np.exp(sinks[None, :, None] - e_lse), 0.0)
    dot = np.abs(np.einsum("bqhd,bqhd->bhq", do.astype(np.float64), e_out))
    assert_close(grads[3], expect[3], "float32", "dsinks", tol=2 * TOL[dtype],
                 scale=float((p_sink * dot).sum(axis=(0, 2)).max()))
    if deterministic:   # the same bits again, the sinks' gradient too
        again = cukern.attention_backward(dod, qd, kd, vd, out, lse, sinks=sd, deterministic=True, **kw)
        for g0, g1 in zip(grads, again):
            np.testing.assert_array_equal(to_host(g0), to_host(g1))


@gpu
@pytest.mark.parametrize("hopper", [True, False], ids=["default-path", "sm80-path"])
def test_packed_sinks_match_the_reference(hopper, monkeypatch):
    monkeypatch.setattr(attn.configs, "CONFIGS", _configs(hopper))
    rng = np.random.default_rng(11)
    lengths = [70, 0, 200, 33, 128]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total, h, hkv, d, dtype = int(cu[-1]), 4, 2, 128, "bfloat16"
    q = random_host(rng, (total, h, d), dtype)
    k, v = random_host(rng, (total, hkv, d), dtype), random_host(rng, (total, hkv, d), dtype)
    do = random_host(rng, q.shape, dtype)
    sinks = (rng.standard_normal(h) * 2).astype(np.float32)
    qd, kd, vd, dod, sd, cud = (to_device(a, "cupy") for a in (q, k, v, do, sinks, cu))
    out, lse = cukern.attention_varlen(qd, kd, vd, cud, cud, 200, 200, causal=True, return_lse=True, sinks=sd)
    e_out, e_lse = ref.attention_varlen(q, k, v, cu, cu, 200, 200, causal=True, return_lse=True, sinks=sinks)
    assert_close(out, e_out, dtype, "out")
    assert_close(lse, e_lse, "float32", "lse", tol=1e-4, scale=1.0)
    grads = cukern.attention_varlen_backward(dod, qd, kd, vd, out, lse, cud, cud, 200, 200, causal=True, sinks=sd)
    expect = ref.attention_varlen_backward(do, q, k, v, None, None, cu, cu, 200, 200, causal=True, sinks=sinks)
    for name, got, e in zip(("dq", "dk", "dv", "dsinks"), grads, expect):
        assert_close(got, e, dtype if name != "dsinks" else "float32", name, tol=2 * TOL[dtype],
                     scale=float(np.sqrt(np.mean(e * e))))


@gpu
@needs_torch
def test_flash_attn_func_learnable_sink_trains_as_the_eager_form():
    """``cukern.torch.flash_attn_func(..., learnable_sink=)`` with a bfloat16 parameter (as
    FlashAttention-4 takes it) against GPT-OSS's eager form in float32: out and every gradient,
    the sink's through the cast; then under torch.compile."""
    import cukern.torch as ct
    from test_attention import _sink_bshd

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 256, 8, 64, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_(True)
    k, v = (torch.randn(2, 256, 2, 64, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_(True)
            for _ in range(2))
    sink = (torch.randn(8, device="cuda", generator=g) * 2).to(torch.bfloat16).requires_grad_(True)
    do = torch.randn(2, 256, 8, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    leaves = (q, k, v, sink)
    out = ct.flash_attn_func(q, k, v, causal=True, learnable_sink=sink)
    got = torch.autograd.grad(out, leaves, do)
    f32 = [t.detach().float().requires_grad_(True) for t in leaves]
    expect = _sink_bshd(*f32[:3], f32[3], True, 64 ** -0.5)
    want = torch.autograd.grad(expect, f32, do.float())
    torch.testing.assert_close(out.float(), expect, rtol=2e-2, atol=2e-2)
    for name, a, e in zip(("dq", "dk", "dv", "dsink"), got, want):
        assert a.dtype == leaves[["dq", "dk", "dv", "dsink"].index(name)].dtype
        torch.testing.assert_close(a.float(), e, rtol=3e-2, atol=3e-2 * float(e.abs().max()), msg=name)
    compiled = torch.compile(lambda *t: ct.flash_attn_func(*t[:3], causal=True, learnable_sink=t[3]), fullgraph=True)
    out_c = compiled(*leaves)
    torch.testing.assert_close(out_c, out, rtol=0, atol=0)
    for a, e in zip(torch.autograd.grad(out_c, leaves, do), got):
        torch.testing.assert_close(a, e, rtol=1e-2, atol=1e-2 * float(e.abs().max()))
