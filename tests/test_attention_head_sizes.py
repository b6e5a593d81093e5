"""A value head size apart from q's and k's (DeepSeek's MLA: 192 for q and k, 128 for v): the
references against PyTorch's autograd; the kernels' plans (the forward on Hopper by its own
kernel, the backward on the sm_80 kernels on every GPU) and their refusals of other pairs by name
on the CPU; on the GPU the kernels against the references (dense, packed, GQA, masks, sinks,
dropout, both dQ paths) and ``cukern.torch`` against PyTorch's SDPA, a second backward,
torch.compile and the SDPA drop-in included."""
from __future__ import annotations

import importlib

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import cukern
from cukern import reference as ref

from arrays import assert_close, poison_allocator, random_host, to_device, to_host, torch
from attention_grads import gradient_scales

gpu = pytest.mark.gpu
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")
M = importlib.import_module("cukern._attention_mask")
attn = importlib.import_module("cukern.attention")
TOL = {"float16": 4e-3, "bfloat16": 2e-2}


@st.composite
def _value_cases(draw):
    """Shapes with a value head size of their own; every row sees a key (sk >= sq with the
    bottom-right mask, whose diagonal is in every window here), as SDPA's reference needs."""
    h, hkv = draw(st.sampled_from([(1, 1), (2, 1), (4, 2), (3, 3)]))
    sq = draw(st.integers(1, 9))
    causal = draw(st.booleans())
    return dict(b=draw(st.integers(1, 2)), sq=sq, sk=draw(st.integers(sq, 12)), h=h, hkv=hkv,
                d=draw(st.sampled_from([8, 16, 24])), dv=draw(st.sampled_from([4, 8, 16, 40])), causal=causal,
                window=(-1, -1) if causal else (draw(st.sampled_from([-1, 0, 3])), draw(st.sampled_from([-1, 0, 2]))),
                scale=draw(st.sampled_from([None, 0.2, 1.5])), seed=draw(st.integers(0, 2**31 - 1)))


@needs_torch
@settings(max_examples=40, deadline=None)
@given(c=_value_cases())
def test_reference_with_a_value_head_size_of_its_own_matches_autograd(c):
    """A value head size apart from q's and k's (MLA's 128 beside 192) in the references, dense
    and packed, against PyTorch's SDPA in float64 (which takes them) with autograd: random
    shapes, GQA, causal masks and windows, scales."""
    b, sq, sk, h, hkv, d, dv = (c[n] for n in ("b", "sq", "sk", "h", "hkv", "d", "dv"))
    rng = np.random.default_rng(c["seed"])
    q, k = rng.standard_normal((b, sq, h, d)), rng.standard_normal((b, sk, hkv, d))
    v, do = rng.standard_normal((b, sk, hkv, dv)), rng.standard_normal((b, sq, h, dv))
    kw = dict(causal=c["causal"], window=c["window"], softmax_scale=c["scale"])
    out, lse = ref.attention(q, k, v, return_lse=True, **kw)
    grads = ref.attention_backward(do, q, k, v, **kw)
    qt, kt, vt = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    keep = torch.as_tensor(M.visible(M.mask_of(c["causal"], c["window"], 0.0, sq, sk), sq, sk))
    rep = h // hkv
    o = torch.nn.functional.scaled_dot_product_attention(
        qt.transpose(1, 2), kt.transpose(1, 2).repeat_interleave(rep, 1), vt.transpose(1, 2).repeat_interleave(rep, 1),
        attn_mask=keep, scale=c["scale"]).transpose(1, 2)
    assert out.shape == (b, sq, h, dv) and lse.shape == (b, h, sq)
    np.testing.assert_allclose(out, o.detach().numpy(), rtol=1e-10, atol=1e-12)
    o.backward(torch.tensor(do))
    for name, got, t in zip(("dq", "dk", "dv"), grads, (qt, kt, vt)):
        assert got.shape == t.shape
        np.testing.assert_allclose(got, t.grad.numpy(), rtol=1e-8, atol=1e-11, err_msg=name)
    # packed: the batch's rows one document each, the same results
    cu = np.arange(0, (b + 1) * sq, sq, dtype=np.int32) if sq == sk else None
    if cu is not None:
        packed = ref.attention_varlen(q.reshape(b * sq, h, d), k.reshape(b * sk, hkv, d), v.reshape(b * sk, hkv, dv),
                                      cu, cu, sq, sk, **kw)
        np.testing.assert_allclose(packed.reshape(out.shape), out, rtol=1e-12, atol=1e-13)


def _launches(info) -> list:
    return [st for st in info.value.plan.steps if isinstance(st, tuple) and st[0] == "launch"]


@pytest.mark.parametrize("cc", [(8, 0), (9, 0)])
def test_mlas_head_sizes_plan_their_kernels(host_arrays_as_device, monkeypatch, cc):
    """q and k 192, v 128: the forward's, the correction's and the backward's kernels take both
    sizes (on Hopper the Hopper kernels: the forward dense and packed, the backward's own kernel
    dense, deterministic in turns), the outputs have v's."""
    from cukern import _faults, _kernels

    from conftest import DryRun

    monkeypatch.setattr(_kernels, "compute_capability", lambda device: cc)
    monkeypatch.setattr(_faults, "record", lambda device: np.zeros(3, np.int64))
    attn = importlib.import_module("cukern.attention")
    # (plans are kept by call signature, not by device)
    attn._FWD.clear(), attn._FWD_VARLEN.clear(), attn._BWD.clear(), attn._BWD_VARLEN.clear()
    q = np.ones((2, 40, 4, 192), np.float16)
    k, v = np.ones((2, 50, 2, 192), np.float16), np.ones((2, 50, 2, 128), np.float16)
    o, lse = np.ones((2, 40, 4, 128), np.float16), np.zeros((2, 4, 40), np.float32)
    with pytest.raises(DryRun) as info:
        cukern.attention(q, k, v, causal=True, return_lse=True)
    fwd = "attention_fwd_sm90<cuk::half, 192, 128, " if cc == (9, 0) else "attention_fwd<cuk::half, 192, 128, "
    steps = _launches(info)
    assert steps[-1][1].name.startswith(fwd), [st[1].name for st in steps]
    plan = info.value.plan
    assert plan.allocs[plan.outputs["out"] - 3].shape == (2, 40, 4, 128)   # (after q, k and v)
    hopper = cc == (9, 0)
    for det, want in ((False, ["attention_bwd_dot<cuk::half, 192, 128>",
                               "attention_bwd_sm90_mla<cuk::half, 1, false, false, " if hopper else
                               "attention_bwd_dkdv<cuk::half, 192, 128, ", "attention_bwd_dq_convert<cuk::half, 192>"]),
                      (True, ["attention_bwd_dot<cuk::half, 192, 128>",
                              "attention_bwd_sm90_mla<cuk::half, 1, false, true, " if hopper else
                              "attention_bwd_dkdv<cuk::half, 192, 128, ",
                              "attention_bwd_dq_convert<cuk::half, 192>" if hopper else
                              "attention_bwd_dq<cuk::half, 192, 128, "])):
        with pytest.raises(DryRun) as info:
            cukern.attention_backward(o, q, k, v, o, lse, causal=True, deterministic=det)
        names = [st[1].name for st in _launches(info)]
        assert len(names) == 3 and all(n.startswith(w) for n, w in zip(names, want)), names
        if hopper:   # (96 keys a block: K and V in boxes of 96 rows, Q and dO of 64; 200 keys, 3 blocks a group)
            k2, v2 = np.ones((2, 200, 2, 192), np.float16), np.ones((2, 200, 2, 128), np.float16)
            with pytest.raises(DryRun) as info:
                cukern.attention_backward(o, q, k2, v2, o, lse, causal=True, deterministic=det)
            _, inst, grid, _, _, slots = _launches(info)[1]
            maps = [(m.index, m.box) for _, m, _ in slots if isinstance(m, _kernels.MapSlot)]
            assert maps[:4] == [(1, (1, 64, 1, 64)), (2, (1, 96, 1, 64)), (3, (1, 96, 1, 64)), (0, (1, 64, 1, 64))]
            assert grid == (3, 4) and inst.smem == 231424
    cu = np.array([0, 10, 40], np.int32)
    with pytest.raises(DryRun) as info:
        cukern.attention_varlen(q[0], k[0, :40], v[0, :40], cu, cu, 30, 30, causal=True)
    assert _launches(info)[0][1].name.startswith(fwd)


def test_the_kernels_refuse_other_value_head_sizes_by_name(host_arrays_as_device):
    lse = np.zeros((1, 2, 8), np.float32)

    def calls(q, k, v):
        return (lambda: cukern.attention(q, k, v), lambda: cukern.attention_backward(q, q, k, v, q, lse),
                lambda: cukern.attention_varlen(q[0], k[0], v[0], np.array([0, 8], np.int32),
                                                np.array([0, 8], np.int32), 8, 8))

    q192, q128 = np.ones((1, 8, 2, 192), np.float16), np.ones((1, 8, 2, 128), np.float16)
    for q, v, pattern in ((q192, q192, "^v: head_dim 192 beside q and k's 192: the kernels take head_dim 192 with a "
                                       "value head size of 128"),
                          (q128, np.ones((1, 8, 2, 64), np.float16),
                           "^v: head_dim 64 differs from k's 128: the kernels take v's head size equal to q and k's, "
                           r"or these pairs of their own \(q and k 192, v 128\)"),
                          (q192, np.ones((1, 8, 1, 128), np.float16),
                           r"^v: shape \((1, )?8, 1, 128\) does not match k's")):
        for call in calls(q, q, v):
            with pytest.raises(ValueError, match=pattern):
                call()
    # dout and out carry v's head size
    k, v = q192, np.ones((1, 8, 2, 128), np.float16)
    for wrong in ("dout", "out"):
        args = dict(dout=v, out=v)
        args[wrong] = q192
        with pytest.raises(ValueError, match=f"^{wrong}: shape \\(1, 8, 2, 192\\) does not match"):
            cukern.attention_backward(args["dout"], q192, k, v, args["out"], lse)


# ---- on the GPU ---------------------------------------------------------------------------------

CASES = [  # (b, sq, sk, h, hkv, causal, window, sinks, dropout_p)
    (2, 128, 128, 4, 2, True, (-1, -1), False, 0.0),
    (1, 200, 333, 4, 4, False, (-1, -1), False, 0.0),
    (2, 96, 160, 6, 2, False, (32, 16), False, 0.0),
    (1, 150, 70, 2, 1, True, (-1, -1), False, 0.0),    # Sq > Sk: rows with no key
    (1, 130, 131, 4, 1, True, (-1, -1), True, 0.0),
    (2, 65, 129, 4, 2, True, (-1, -1), False, 0.15),
    (1, 1, 17, 2, 2, False, (-1, -1), False, 0.0),
    (2, 700, 1100, 8, 2, True, (-1, -1), False, 0.0),   # many key tiles, the ring wrapping round
    (1, 600, 1000, 4, 4, False, (300, 200), False, 0.0),
    (1, 400, 130, 4, 2, False, (-1, -1), False, 0.0),   # more query tiles than key blocks, unmasked
]


@gpu
@pytest.mark.parametrize("dtype, framework, deterministic", [("bfloat16", "cupy", False), ("float16", "torch", True),
                                                             ("bfloat16", "torch", True)])
@pytest.mark.parametrize("case", CASES, ids=[f"c{i}" for i in range(len(CASES))])
def test_mla_forward_and_backward_match_the_reference(case, dtype, framework, deterministic):
    b, sq, sk, h, hkv, causal, window, with_sinks, p = case
    rng = np.random.default_rng(sq + sk)
    q = random_host(rng, (b, sq, h, 192), dtype)
    k, v = random_host(rng, (b, sk, hkv, 192), dtype), random_host(rng, (b, sk, hkv, 128), dtype)
    do = random_host(rng, (b, sq, h, 128), dtype)
    sinks = (rng.standard_normal(h) * 2).astype(np.float32) if with_sinks else None
    seed, offset = int(rng.integers(0, 2**62)), int(rng.integers(0, 2**32))
    kw = dict(causal=causal, window=window)
    dev = {"sinks": to_device(sinks, framework) if with_sinks else None}
    host = {"sinks": sinks}
    if p:
        kw["dropout_p"] = p
        dev["dropout_rng"] = (torch.tensor([seed, offset], dtype=torch.int64, device="cuda") if framework == "torch"
                              else to_device(np.array([seed, offset], np.int64), framework))
        host["dropout_rng"] = (seed, offset)
    qd, kd, vd, dod = (to_device(a, framework) for a in (q, k, v, do))
    poison_allocator(framework, [b * sq * h * 128 * 2, b * h * sq * 4])
    out, lse = cukern.attention(qd, kd, vd, return_lse=True, **kw, **dev)
    e_out, e_lse = ref.attention(q, k, v, return_lse=True, **kw, **host)
    assert tuple(out.shape) == (b, sq, h, 128)
    assert_close(out, e_out, dtype, "out", tol=TOL[dtype])
    got = to_host(lse)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(e_lse))
    seen = np.isfinite(e_lse)
    assert_close(got[seen], e_lse[seen], "float32", "lse", tol=1e-4, scale=1.0)
    poison_allocator(framework, [q.nbytes, k.nbytes, v.nbytes])
    grads = cukern.attention_backward(dod, qd, kd, vd, out, lse, deterministic=deterministic, **kw, **dev)
    expect = ref.attention_backward(do, q, k, v, **kw, **host)
    scales = gradient_scales(do, q, k, v, causal, None, window)
    assert [tuple(g.shape) for g in grads[:3]] == [q.shape, k.shape, v.shape]
    for name, got, e, sc in zip(("dq", "dk", "dv"), grads[:3], expect[:3], scales):
        assert_close(got, e, dtype, name, tol=2 * TOL[dtype], scale=sc / (1 - p))
    if with_sinks:
        assert_close(grads[3], expect[3], "float32", "dsinks", tol=2 * TOL[dtype],
                     scale=float(np.abs(expect[3]).max()) + 1e-3)
    if deterministic:   # the same bits again
        again = cukern.attention_backward(dod, qd, kd, vd, out, lse, deterministic=True, **kw, **dev)
        for g0, g1 in zip(grads, again):
            np.testing.assert_array_equal(to_host(g0), to_host(g1))


@gpu
@pytest.mark.parametrize("deterministic", [False, True])
def test_packed_mla_matches_the_reference(deterministic):
    rng = np.random.default_rng(5)
    lengths = [70, 0, 200, 33, 128]
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total, h, hkv, dtype = int(cu[-1]), 4, 2, "bfloat16"
    q = random_host(rng, (total, h, 192), dtype)
    k, v = random_host(rng, (total, hkv, 192), dtype), random_host(rng, (total, hkv, 128), dtype)
    do = random_host(rng, (total, h, 128), dtype)
    qd, kd, vd, dod, cud = (to_device(a, "cupy") for a in (q, k, v, do, cu))
    out, lse = cukern.attention_varlen(qd, kd, vd, cud, cud, 200, 200, causal=True, return_lse=True)
    e_out, e_lse = ref.attention_varlen(q, k, v, cu, cu, 200, 200, causal=True, return_lse=True)
    assert_close(out, e_out, dtype, "out")
    assert_close(lse, e_lse, "float32", "lse", tol=1e-4, scale=1.0)
    grads = cukern.attention_varlen_backward(dod, qd, kd, vd, out, lse, cud, cud, 200, 200, causal=True,
                                             deterministic=deterministic)
    expect = ref.attention_varlen_backward(do, q, k, v, None, None, cu, cu, 200, 200, causal=True)
    for name, got, e in zip(("dq", "dk", "dv"), grads, expect):
        assert tuple(got.shape) == e.shape
        assert_close(got, e, dtype, name, tol=2 * TOL[dtype], scale=float(np.sqrt(np.mean(e * e))))


@gpu
@needs_torch
def test_flash_attn_func_with_mlas_head_sizes_trains_as_pytorchs_sdpa():
    """``cukern.torch.flash_attn_func`` with q and k 192, v 128 against PyTorch's SDPA in float32
    (which takes a value head size of its own): out and every gradient; a second backward through
    the same graph gives the same gradients; torch.compile gives the same; the SDPA drop-in routes
    the call to the kernels."""
    import cukern.torch as ct

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 256, 8, 192, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_(True)
    k = torch.randn(2, 256, 2, 192, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_(True)
    v = torch.randn(2, 256, 2, 128, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_(True)
    do = torch.randn(2, 256, 8, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    leaves = (q, k, v)
    out = ct.flash_attn_func(q, k, v, causal=True)
    assert out.shape == (2, 256, 8, 128)
    got = torch.autograd.grad(out, leaves, do, retain_graph=True)
    again = torch.autograd.grad(out, leaves, do)
    for a, b in zip(got, again):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-2 * float(a.abs().max()))
    f32 = [t.detach().float().requires_grad_(True) for t in leaves]
    expect = torch.nn.functional.scaled_dot_product_attention(
        f32[0].transpose(1, 2), f32[1].transpose(1, 2), f32[2].transpose(1, 2), is_causal=True,
        enable_gqa=True).transpose(1, 2)
    want = torch.autograd.grad(expect, f32, do.float())
    torch.testing.assert_close(out.float(), expect, rtol=2e-2, atol=2e-2)
    for name, a, e in zip(("dq", "dk", "dv"), got, want):
        assert a.shape == e.shape and a.dtype == torch.bfloat16
        torch.testing.assert_close(a.float(), e, rtol=3e-2, atol=3e-2 * float(e.abs().max()), msg=name)
    compiled = torch.compile(lambda *t: ct.flash_attn_func(*t, causal=True), fullgraph=True)
    out_c = compiled(*leaves)
    torch.testing.assert_close(out_c, out, rtol=0, atol=0)
    for a, e in zip(torch.autograd.grad(out_c, leaves, do), got):
        torch.testing.assert_close(a, e, rtol=1e-2, atol=1e-2 * float(e.abs().max()))
    # the SDPA drop-in: (B, H, S, D) with v's 128, GQA (min_size=0: this call is below the default's);
    # on Hopper left to PyTorch's cuDNN kernel, faster there than the sm_80 kernels, with the reason
    from cukern import _kernels

    ct.reset_counts()
    with ct.patch(min_size=0):
        o = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                             is_causal=True, enable_gqa=True)
    counts = ct.counts(reasons=True)["scaled_dot_product_attention"]
    if _kernels.compute_capability(0) == (9, 0):
        assert counts == {"cukern": 0, "torch": 1, "torch_reasons": {
            "MLA's head sizes on Hopper (PyTorch's cuDNN kernel is faster there)": 1}}, counts
        torch.testing.assert_close(o.transpose(1, 2), out, rtol=2e-2, atol=2e-2)
    else:
        assert counts == {"cukern": 1, "torch": 0}, counts
        torch.testing.assert_close(o.transpose(1, 2), out, rtol=0, atol=0)
