"""Attention dropout (``dropout_p``, ``dropout_rng``): the reference, the weights dropped by the
Philox mask the kernels draw (``dropout_keep_mask``), the kept scaled by 1 / (1 - p), against
PyTorch's autograd of the same composite in float64, forward and backward, with a causal mask,
GQA and sinks; the mask's draw, where each element is drawn, dense and packed; the arguments'
checks on the CPU; and on the GPU the kernels (dense and packed, every head size, every mask,
both backwards) against the reference drawing the same mask."""
from __future__ import annotations

import importlib

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import cukern
from cukern import reference as ref
from arrays import assert_close, ints_to_device, poison_allocator, random_host, to_device, to_host, torch
from attention_grads import gradient_scales

gpu = pytest.mark.gpu
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")
attn = importlib.import_module("cukern.attention")
R = importlib.import_module("cukern.attention.reference")
M = importlib.import_module("cukern._attention_mask")


@needs_torch
@pytest.mark.parametrize("causal, sinks", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("p", [0.1, 0.5])
def test_reference_dropout_matches_autograd_of_the_dropped_softmax(causal, sinks, p):
    rng = np.random.default_rng(int(p * 10) + 2 * causal + sinks)
    b, sq, sk, h, hkv, d = 2, 9, 11, 4, 2, 8
    q = rng.standard_normal((b, sq, h, d))
    k, v = rng.standard_normal((b, sk, hkv, d)), rng.standard_normal((b, sk, hkv, d))
    do = rng.standard_normal(q.shape)
    s_h = rng.standard_normal(h) if sinks else None
    keep = R.dropout_keep_mask(p, seed=1234, offset=5, batch=b, heads=h, sq=sq, sk=sk)
    assert 0 < keep.mean() < 1
    mask = M.mask_of(causal, (-1, -1), 0.0, sq, sk)
    out, lse = R._ref_forward(q, k, v, 0.3, mask, s_h, keep, p)
    grads = R._ref_backward(do, q, k, v, 0.3, mask, s_h, keep, p)

    qt, kt, vt = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    st = torch.tensor(s_h, requires_grad=True) if sinks else None
    kk, vv = (a.transpose(1, 2).repeat_interleave(h // hkv, 1) for a in (kt, vt))
    s = (qt.transpose(1, 2) @ kk.transpose(-1, -2)) * 0.3
    s = s.masked_fill(~torch.as_tensor(M.visible(mask, sq, sk)), -float("inf"))
    if sinks:
        s = torch.cat([s, st.reshape(1, -1, 1, 1).expand(b, -1, sq, 1)], dim=-1)
    w = torch.softmax(s, -1)[..., :sk]
    w = torch.where(torch.as_tensor(keep), w / (1 - p), torch.zeros_like(w))
    o = (w @ vv).transpose(1, 2)
    np.testing.assert_allclose(out, o.detach().numpy(), rtol=1e-11, atol=1e-12)
    o.backward(torch.tensor(do))
    leaves = (qt, kt, vt) + ((st,) if sinks else ())
    assert len(grads) == len(leaves)
    for name, got, t in zip(("dq", "dk", "dv", "dsinks"), grads, leaves):
        np.testing.assert_allclose(got, t.grad.numpy(), rtol=1e-9, atol=1e-11, err_msg=name)


def test_each_element_is_drawn_at_its_own_place():
    """Dense: (b * H + h, i, j); packed: the document's tokens' places in the pack. Two calls
    (offsets) and two seeds draw different masks; the same arguments draw the same one."""
    a = R.dropout_keep_mask(0.5, 3, 0, 2, 3, 5, 7)
    assert a.shape == (2, 3, 5, 7) and np.array_equal(a, R.dropout_keep_mask(0.5, 3, 0, 2, 3, 5, 7))
    assert not np.array_equal(a, R.dropout_keep_mask(0.5, 3, 1, 2, 3, 5, 7))
    assert not np.array_equal(a, R.dropout_keep_mask(0.5, 4, 0, 2, 3, 5, 7))
    whole = R.dropout_keep_mask(0.5, 3, 0, 1, 6, 5, 7)      # (one batch of 6 heads: bh = h)
    np.testing.assert_array_equal(a.reshape(1, 6, 5, 7), whole)   # (b * 3 + h: the same draws)
    doc = R.dropout_keep_mask(0.5, 3, 0, 1, 3, 4, 6, q0=10, k0=20)
    pack = R.dropout_keep_mask(0.5, 3, 0, 1, 3, 14, 26)
    np.testing.assert_array_equal(doc, pack[:, :, 10:14, 20:26])



# ---- the arguments, without a GPU -----------------------------------------------------------------

def test_dropout_argument_checks_without_a_gpu(host_arrays_as_device):
    """dropout_p in [0, 1), the draw's array (2,) int64, not with the softcap; a valid call runs
    the sm_80 kernels' dropout instances (on this dry run's sm_80 device; Hopper: the next test)
    and hands them the draw's array."""
    from conftest import DryRun

    q = np.ones((2, 8, 4, 64), np.float16)
    kv = np.ones((2, 8, 2, 64), np.float16)
    lse = np.zeros((2, 4, 8), np.float32)
    rng = np.array([5, 7], np.int64)
    cu = np.array([0, 8], np.int32)
    calls = (lambda **kw: cukern.attention(q, kv, kv, **kw),
             lambda **kw: cukern.attention_backward(q, q, kv, kv, q, lse, **kw),
             lambda **kw: cukern.attention_varlen(q[0], kv[0], kv[0], cu, cu, 8, 8, **kw))
    for kw, exc, pattern in ((dict(dropout_p=1.0, dropout_rng=rng), ValueError,
                              r"^dropout_p: must be a number in \[0, 1\)"),
                             (dict(dropout_p=-0.1, dropout_rng=rng), ValueError, "^dropout_p: "),
                             (dict(dropout_p=float("nan"), dropout_rng=rng), ValueError, "^dropout_p: "),
                             (dict(dropout_p="0.1", dropout_rng=rng), ValueError, "^dropout_p: "),
                             (dict(dropout_p=0.1), ValueError, "^dropout_rng: dropout_p > 0 needs"),
                             (dict(dropout_p=0.1, dropout_rng=np.array([5, 7, 9], np.int64)), ValueError,
                              r"^dropout_rng: shape \(3,\)"),
                             (dict(dropout_p=0.1, dropout_rng=np.array([5, 7], np.int32)), ValueError,
                              "^dropout_rng: dtype int32"),
                             (dict(dropout_p=0.1, dropout_rng=rng, softcap=30.0), ValueError,
                              "^dropout_p: 0.1 with softcap 30.0")):
        for call in calls:
            with pytest.raises(exc, match=pattern):
                call(**kw)
    # (the DROPOUT template argument of each kernel: attention_fwd's 11th, attention_bwd_dkdv's
    # 12th, attention_bwd_dq's 8th)
    at = {"attention_fwd<": 10, "attention_bwd_dkdv<": 11, "attention_bwd_dq<": 7}
    for call, kernels in ((calls[0], ["attention_fwd<"]), (calls[1], ["attention_bwd_dkdv<"]),
                          (lambda **kw: calls[1](deterministic=True, **kw),
                           ["attention_bwd_dkdv<", "attention_bwd_dq<"])):
        with pytest.raises(DryRun) as e:
            call(dropout_p=0.25, dropout_rng=rng)
        launches = [step for step in e.value.plan.steps if isinstance(step, tuple) and step[0] == "launch"]
        for name in kernels:
            ours = [step for step in launches if step[1].name.startswith(name)]
            assert ours, (name, [step[1].name for step in launches])
            for step in ours:
                assert step[1].name[len(name):-1].split(", ")[at[name]] == "true", step[1].name
                assert step[4]["drop_threshold"] == int(0.25 * 2**16)
                assert step[4]["drop_rescale"] == pytest.approx(4 / 3)
    with pytest.raises(DryRun):   # (dropout_p = 0: no draw needed, none taken)
        calls[0](dropout_p=0.0)


def test_hopper_takes_dropout_on_its_own_kernels(host_arrays_as_device, monkeypatch):
    """On sm_90 the Hopper forward (d64, d128, d256) and backward (d64, d128: dense, its dropout
    configs) take dropout, handed the draw's array; d256's backward and ``use_sm90_dropout=False``
    keep the sm_80 kernels' dropout instances (packed documents too, which this dry run cannot
    plan without a device)."""
    import dataclasses

    from cukern import _kernels

    from conftest import DryRun

    monkeypatch.setattr(_kernels, "compute_capability", lambda device: (9, 0))
    rng = np.array([5, 7], np.int64)

    def launches(call, configs=None, **kw):
        attn._FWD.clear(), attn._BWD.clear(), attn._FWD_VARLEN.clear(), attn._BWD_VARLEN.clear()
        if configs is not None:
            monkeypatch.setattr(attn.configs, "CONFIGS", configs)
        with pytest.raises(DryRun) as e:
            call(**kw)
        return [st for st in e.value.plan.steps if isinstance(st, tuple) and st[0] == "launch"]

    def args(name):   # (the template arguments of an instance name)
        return name[name.index("<") + 1:-1].split(", ")

    shipped = attn.configs.CONFIGS
    for d in (64, 128, 256):
        q = np.ones((2, 300, 4, d), np.float16)
        kv = np.ones((2, 300, 2, d), np.float16)
        lse = np.zeros((2, 4, 300), np.float32)
        for causal in (False, True):
            (fwd,) = launches(lambda **kw: cukern.attention(q, kv, kv, causal=causal, **kw), shipped,
                              dropout_p=0.25, dropout_rng=rng)
            cfg = shipped.sm90_forward(d, causal, dropout=True)
            assert fwd[1].name == cfg.instance("float16", d, int(causal), dropout=True).name
            assert args(fwd[1].name)[-1] == "true" and fwd[4]["drop_rng"] is not None
            assert fwd[4]["drop_threshold"] == int(0.25 * 2**16) and fwd[4]["drop_rescale"] == pytest.approx(4 / 3)
            (plain,) = launches(lambda **kw: cukern.attention(q, kv, kv, causal=causal, **kw))
            assert args(plain[1].name)[-1] == "false" and plain[4]["drop_threshold"] == 0
            for det in (False, True):
                steps = launches(lambda **kw: cukern.attention_backward(q, q, kv, kv, q, lse, causal=causal,
                                                                        deterministic=det, **kw),
                                 dropout_p=0.25, dropout_rng=rng)
                names = [st[1].name.split("<")[0] for st in steps]
                if d == 256:   # (d256's Hopper backward takes no dropout)
                    assert "attention_bwd_dkdv" in names and "attention_bwd_sm90_d256" not in names
                    continue
                (k,) = [st for st in steps if st[1].name.startswith("attention_bwd_sm90<")]
                cfg = shipped.sm90_backward(d, dropout=True)
                assert args(k[1].name)[1:3] == [str(d), str(cfg.block_rows)] and args(k[1].name)[-1] == "true"
                assert k[4]["drop_threshold"] == int(0.25 * 2**16) and k[4]["drop_rescale"] == pytest.approx(4 / 3)
                ordered = args(k[1].name)[-2] == "true"
                assert ordered == (det and cfg.orders(d, int(causal), 3, 66))
                if det and not ordered:   # (dQ's own pass, with the draw)
                    (dq,) = [st for st in steps if st[1].name.startswith("attention_bwd_dq<")]
                    assert args(dq[1].name)[7] == "true" and dq[4]["drop_threshold"] == int(0.25 * 2**16)
    # the switch off: the sm_80 kernels' dropout
    off = dataclasses.replace(shipped, use_sm90_dropout=False)
    q = np.ones((2, 300, 4, 128), np.float16)
    lse = np.zeros((2, 4, 300), np.float32)
    (fwd,) = launches(lambda **kw: cukern.attention(q, q, q, **kw), off, dropout_p=0.1, dropout_rng=rng)
    assert fwd[1].name.startswith("attention_fwd<")
    steps = launches(lambda **kw: cukern.attention_backward(q, q, q, q, q, lse, **kw), off, dropout_p=0.1,
                     dropout_rng=rng)
    assert "attention_bwd_dkdv" in [st[1].name.split("<")[0] for st in steps]
    # ... and the instances are in the compile check
    names = {i.name for i in attn.configs.instances(shipped)}
    assert {shipped.sm90_forward(d, m > 0, dropout=True).instance(dt, d, m, dropout=True).name
            for dt in ("float16", "bfloat16") for d in (64, 128, 256) for m in (0, 1, 2)} <= names
    assert {shipped.sm90_backward(d, dropout=True).instance(dt, d, m, det, dropout=True).name
            for dt in ("float16", "bfloat16") for d in (64, 128) for m in (0, 1, 2) for det in (False, True)} <= names
    monkeypatch.setattr(attn.configs, "CONFIGS", shipped)
    attn._FWD.clear(), attn._BWD.clear(), attn._FWD_VARLEN.clear(), attn._BWD_VARLEN.clear()


# ---- on the GPU -------------------------------------------------------------------------------------

TOL = {"float16": 4e-3, "bfloat16": 2e-2}

CASES = [  # (b, sq, sk, h, hkv, d, causal, window, p)
    (2, 128, 128, 4, 2, 64, True, (-1, -1), 0.1),
    (1, 200, 333, 4, 4, 128, False, (-1, -1), 0.3),
    (2, 96, 160, 6, 2, 128, False, (32, 16), 0.5),
    (1, 150, 70, 2, 1, 64, True, (-1, -1), 0.2),     # Sq > Sk: rows with no key
    (1, 77, 90, 4, 2, 32, False, (-1, -1), 0.1),
    (1, 100, 64, 2, 1, 96, True, (-1, -1), 0.1),
    (1, 64, 96, 2, 2, 256, False, (-1, -1), 0.4),
    # (the Hopper kernels' walks: several query tiles and key blocks, GQA, every mask)
    (2, 384, 384, 4, 2, 64, False, (-1, -1), 0.15),
    (1, 320, 320, 8, 2, 128, True, (-1, -1), 0.1),
    (1, 300, 400, 4, 1, 128, False, (100, 0), 0.25),
    (1, 260, 260, 2, 2, 256, True, (-1, -1), 0.2),
]


def _rng(framework, seed, offset):
    if framework == "torch":
        return torch.tensor([seed, offset], dtype=torch.int64, device="cuda")
    return to_device(np.array([seed, offset], np.int64), framework)


def _assert_lse(lse, expect):
    """Finite where the reference's is, +inf (a row that sees no key) where it is."""
    got = to_host(lse)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(expect))
    seen = np.isfinite(expect)
    assert_close(got[seen], expect[seen], "float32", "lse", tol=1e-4, scale=1.0)


@gpu
@pytest.mark.parametrize("dtype, framework, deterministic", [("bfloat16", "cupy", False), ("float16", "torch", True),
                                                             ("bfloat16", "torch", True)])
@pytest.mark.parametrize("case", CASES, ids=[f"c{i}" for i in range(len(CASES))])
def test_dropout_forward_and_backward_match_the_reference(case, dtype, framework, deterministic):
    b, sq, sk, h, hkv, d, causal, window, p = case
    rng = np.random.default_rng(sq + sk + d)
    q = random_host(rng, (b, sq, h, d), dtype)
    k, v = random_host(rng, (b, sk, hkv, d), dtype), random_host(rng, (b, sk, hkv, d), dtype)
    do = random_host(rng, q.shape, dtype)
    seed, offset = int(rng.integers(0, 2**63)), int(rng.integers(0, 2**32))
    kw = dict(causal=causal, window=window, dropout_p=p)
    qd, kd, vd, dod = (to_device(a, framework) for a in (q, k, v, do))
    rd = _rng(framework, seed, offset)
    poison_allocator(framework, [q.nbytes, b * h * sq * 4])
    out, lse = cukern.attention(qd, kd, vd, return_lse=True, dropout_rng=rd, **kw)
    e_out, e_lse = ref.attention(q, k, v, return_lse=True, dropout_rng=(seed, offset), **kw)
    assert_close(out, e_out, dtype, "out", tol=TOL[dtype])
    _assert_lse(lse, e_lse)
    # (the mask differs from no dropout's, and from another offset's)
    plain = ref.attention(q, k, v, causal=causal, window=window)
    assert np.abs(to_host(out).astype(np.float64) - plain).max() > 0.1
    other = cukern.attention(qd, kd, vd, dropout_rng=_rng(framework, seed, offset + 1), **kw)
    assert not np.array_equal(to_host(other), to_host(out))
    poison_allocator(framework, [q.nbytes, k.nbytes, k.nbytes])
    grads = cukern.attention_backward(dod, qd, kd, vd, out, lse, deterministic=deterministic, dropout_rng=rd, **kw)
    expect = ref.attention_backward(do, q, k, v, dropout_rng=(seed, offset), **kw)
    scales = gradient_scales(do, q, k, v, causal, None, window)
    for name, got, e, sc in zip(("dq", "dk", "dv"), grads, expect, scales):
        assert_close(got, e, dtype, name, tol=2 * TOL[dtype], scale=sc / (1 - p))
    if deterministic:   # the same bits again
        again = cukern.attention_backward(dod, qd, kd, vd, out, lse, deterministic=True, dropout_rng=rd, **kw)
        for g0, g1 in zip(grads, again):
            np.testing.assert_array_equal(to_host(g0), to_host(g1))


@gpu
@settings(max_examples=40)
@given(c=st.fixed_dictionaries(dict(
    b=st.sampled_from([1, 2]), sq=st.sampled_from([1, 31, 64, 129, 200, 260]),
    sk=st.sampled_from([1, 17, 64, 100, 129, 257, 300]), heads=st.sampled_from([(1, 1), (4, 2), (4, 1), (3, 3)]),
    d=st.sampled_from([32, 64, 64, 96, 128, 128, 256]), dtype=st.sampled_from(["float16", "bfloat16"]),
    mask=st.sampled_from(["none", "causal", "causal", "window"]), p=st.sampled_from([0.05, 0.2, 0.5, 0.9]),
    framework=st.sampled_from(["cupy", "torch"]), deterministic=st.booleans(),
    seed=st.integers(0, 2**63 - 1), offset=st.integers(0, 2**32 - 1))))
def test_dropout_matches_the_reference_over_shapes(c):
    """Forward and backward with dropout at any length (key blocks cut short, rows that see no
    key), head dims, GQA, every mask and both backwards against the NumPy reference drawing the
    same mask: the Hopper kernels' key orders and draws (the backward's rows in Philox order) at
    every edge."""
    h, hkv = c["heads"]
    dt, fw = c["dtype"], c["framework"]
    rng = np.random.default_rng(c["offset"])
    q = random_host(rng, (c["b"], c["sq"], h, c["d"]), dt)
    k, v = random_host(rng, (c["b"], c["sk"], hkv, c["d"]), dt), random_host(rng, (c["b"], c["sk"], hkv, c["d"]), dt)
    do = random_host(rng, q.shape, dt)
    window = (37, 5) if c["mask"] == "window" else (-1, -1)
    kw = dict(causal=c["mask"] == "causal", window=window, dropout_p=c["p"])
    qd, kd, vd, dod = (to_device(a, fw) for a in (q, k, v, do))
    rd = _rng(fw, c["seed"], c["offset"])
    out, lse = cukern.attention(qd, kd, vd, return_lse=True, dropout_rng=rd, **kw)
    e_out, e_lse = ref.attention(q, k, v, return_lse=True, dropout_rng=(c["seed"], c["offset"]), **kw)
    assert_close(out, e_out, dt, "out", tol=TOL[dt])
    _assert_lse(lse, e_lse)
    grads = cukern.attention_backward(dod, qd, kd, vd, out, lse, deterministic=c["deterministic"], dropout_rng=rd,
                                      **kw)
    expect = ref.attention_backward(do, q, k, v, dropout_rng=(c["seed"], c["offset"]), **kw)
    scales = gradient_scales(do, q, k, v, kw["causal"], None, window)
    for name, got, e, sc in zip(("dq", "dk", "dv"), grads, expect, scales):
        assert_close(got, e, dt, name, tol=2 * TOL[dt], scale=sc / (1 - c["p"]))


def _packed(seed, lengths, d, h=4, hkv=2, dtype="bfloat16"):
    """Packed documents of these lengths: the offsets (int32) and random q, k, v and do."""
    rng = np.random.default_rng(seed)
    cu = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    total = int(cu[-1])
    q = random_host(rng, (total, h, d), dtype)
    k, v = random_host(rng, (total, hkv, d), dtype), random_host(rng, (total, hkv, d), dtype)
    return cu, q, k, v, random_host(rng, q.shape, dtype)


@gpu
@pytest.mark.parametrize("deterministic", [False, True])
def test_packed_dropout_matches_the_reference(deterministic):
    """Documents that start at odd tokens: a thread's key pair then straddles two Philox calls."""
    dtype = "bfloat16"
    cu, q, k, v, do = _packed(12, [71, 0, 200, 33, 127], 128)
    kw = dict(causal=True, dropout_p=0.2)
    qd, kd, vd, dod, cud = (to_device(a, "cupy") for a in (q, k, v, do, cu))
    rd = _rng("cupy", 99, 3)
    out, lse = cukern.attention_varlen(qd, kd, vd, cud, cud, 200, 200, return_lse=True, dropout_rng=rd, **kw)
    e_out, e_lse = ref.attention_varlen(q, k, v, cu, cu, 200, 200, return_lse=True, dropout_rng=(99, 3),
                                                     **kw)
    assert_close(out, e_out, dtype, "out")
    _assert_lse(lse, e_lse)
    grads = cukern.attention_varlen_backward(dod, qd, kd, vd, out, lse, cud, cud, 200, 200, dropout_rng=rd,
                                             deterministic=deterministic, **kw)
    expect = ref.attention_varlen_backward(do, q, k, v, None, None, cu, cu, 200, 200,
                                                        dropout_rng=(99, 3), **kw)
    for name, got, e in zip(("dq", "dk", "dv"), grads, expect):
        assert_close(got, e, dtype, name, tol=2 * TOL[dtype], scale=float(np.sqrt(np.mean(e * e))))


def _torch_qkv(b=2, s=200, h=8, hkv=2, d=64):
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, s, h, d, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_(True)
    k, v = (torch.randn(b, s, hkv, d, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_(True)
            for _ in range(2))
    do = torch.randn(b, s, h, d, device="cuda", generator=g, dtype=torch.bfloat16)
    return q, k, v, do


def _assert_dropped_as_drawn(out, q, k, v, rng, p, grads=None, do=None):
    """out (and the gradients, where given) are PyTorch's autograd of the weights that the draw
    ``rng`` drops (causal)."""
    from test_attention import _dropout_bshd

    leaves = [t.detach().float().requires_grad_(True) for t in (q, k, v)]
    expect = _dropout_bshd(*leaves, rng.cpu(), True, q.shape[-1] ** -0.5, p)
    torch.testing.assert_close(out.float(), expect, rtol=2e-2, atol=2e-2)
    if grads is not None:
        for got, want in zip(grads, torch.autograd.grad(expect, leaves, do.float())):
            torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2)


@gpu
@needs_torch
def test_torch_dropout_is_seeded_by_pytorchs_generator_and_trains_as_the_eager_form():
    """``cukern.torch.flash_attn_func(dropout_p=)``: the draw comes from the CUDA generator
    (``torch.manual_seed`` repeats a call, the next call draws apart), and the out and gradients
    equal PyTorch's autograd of the weights dropped by that draw; a second backward gives the
    same dK and dV bits (dQ's float32 sums, added in whatever order the blocks finish, to a
    rounding; all three with ``deterministic=True``). On Hopper the SDPA drop-in takes dropout
    on the kernels (the same draw, so the same out), elsewhere it leaves it to PyTorch, counted."""
    import cukern.torch as ct
    from cukern.attention.torch import dropout_draw, dropout_route_reason

    q, k, v, do = _torch_qkv()
    torch.manual_seed(3)
    out = ct.flash_attn_func(q, k, v, dropout_p=0.2, causal=True)
    torch.manual_seed(3)
    rng = dropout_draw(q.device)   # (the draw the call made)
    grads = torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
    again = torch.autograd.grad(out, (q, k, v), do)
    assert torch.equal(grads[1], again[1]) and torch.equal(grads[2], again[2])
    torch.testing.assert_close(grads[0], again[0], rtol=1e-2, atol=1e-3)
    _assert_dropped_as_drawn(out, q, k, v, rng, 0.2, grads, do)
    torch.manual_seed(3)
    fixed = ct.flash_attn_func(q, k, v, dropout_p=0.2, causal=True, deterministic=True)
    assert torch.equal(fixed, out)
    grads = torch.autograd.grad(fixed, (q, k, v), do, retain_graph=True)
    for a, b in zip(grads, torch.autograd.grad(fixed, (q, k, v), do)):
        assert torch.equal(a, b)
    torch.manual_seed(3)
    assert torch.equal(ct.flash_attn_func(q, k, v, dropout_p=0.2, causal=True), out)
    assert not torch.equal(ct.flash_attn_func(q, k, v, dropout_p=0.2, causal=True), out)
    import torch.nn.functional as F

    ct.reset_counts()
    with ct.patch(min_size=0):
        torch.manual_seed(3)
        o = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), dropout_p=0.2, is_causal=True,
                                           enable_gqa=True)
    counts = ct.counts(reasons=True)["scaled_dot_product_attention"]
    why = dropout_route_reason(q.device, 64, 64)
    if why is None:
        assert counts["cukern"] == 1 and counts["torch"] == 0, counts
        assert torch.equal(o.transpose(1, 2), out)
    else:
        assert counts == {"cukern": 0, "torch": 1, "torch_reasons": {why: 1}}


@gpu
@needs_torch
@pytest.mark.parametrize("deterministic", [False, True])
def test_torch_packed_dropout_matches_the_reference(deterministic):
    """``flash_attn_varlen_func(dropout_p=)``: packed documents (one empty, one of a token, odd
    starts), the draw from PyTorch's generator, out and gradients against the NumPy reference
    of the weights that draw drops (each token at its place in the pack)."""
    import cukern.torch as ct
    from cukern.attention.torch import dropout_draw

    dtype = "bfloat16"
    cu, q, k, v, do = _packed(5, [71, 0, 130, 1, 45], 64)
    qt, kt, vt = (to_device(a, "torch").requires_grad_(True) for a in (q, k, v))
    dot, cut = to_device(do, "torch"), ints_to_device(cu, "torch")
    torch.manual_seed(9)
    out = ct.flash_attn_varlen_func(qt, kt, vt, cut, cut, 130, 130, dropout_p=0.25, causal=True,
                                    deterministic=deterministic)
    torch.manual_seed(9)
    drawn = dropout_draw(qt.device).cpu()
    draw = (int(drawn[0]) % 2**64, int(drawn[1]) % 2**32)
    kw = dict(causal=True, dropout_p=0.25, dropout_rng=draw)
    assert_close(out.detach(), ref.attention_varlen(q, k, v, cu, cu, 130, 130, **kw), dtype, "out")
    grads = torch.autograd.grad(out, (qt, kt, vt), dot)
    expect = ref.attention_varlen_backward(do, q, k, v, None, None, cu, cu, 130, 130, **kw)
    for name, got, e in zip(("dq", "dk", "dv"), grads, expect):
        assert_close(got, e, dtype, name, tol=2 * TOL[dtype], scale=float(np.sqrt(np.mean(e * e))))
    assert not torch.equal(ct.flash_attn_varlen_func(qt, kt, vt, cut, cut, 130, 130, dropout_p=0.25, causal=True),
                           out)


@gpu
@needs_torch
def test_torch_dropout_draws_anew_in_each_cuda_graph_replay():
    """Captured in a CUDA graph, ``flash_attn_func(dropout_p=)`` draws on the device at each
    replay (as PyTorch's dropout does): replays drop different weights, each the weights its
    draw names; ``torch.manual_seed`` before a replay repeats it."""
    import cukern.torch as ct
    from cukern.attention import torch as at

    q, k, v, _ = _torch_qkv(1, 160, 4, 4, 64)
    drawn = []
    real = at.dropout_draw

    def recorded(device):   # (the draw's tensor: the graph refills it at each replay)
        drawn.append(real(device))
        return drawn[-1]

    at.dropout_draw = recorded
    try:
        with torch.no_grad():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):   # (the kernels compiled and loaded before the capture)
                ct.flash_attn_func(q, k, v, dropout_p=0.3, causal=True)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = ct.flash_attn_func(q, k, v, dropout_p=0.3, causal=True)
    finally:
        at.dropout_draw = real
    rng = drawn[-1]
    seen = []
    for seed in (5, None, 5):
        if seed is not None:
            torch.manual_seed(seed)
        graph.replay()
        torch.cuda.synchronize()
        _assert_dropped_as_drawn(out, q, k, v, rng, 0.3)
        seen.append((rng.clone(), out.clone()))
    assert not torch.equal(seen[0][0], seen[1][0]) and not torch.equal(seen[0][1], seen[1][1])
    assert torch.equal(seen[0][0], seen[2][0]) and torch.equal(seen[0][1], seen[2][1])


@gpu
@needs_torch
def test_torch_dropout_draws_anew_in_each_compiled_call():
    """Under torch.compile the draw is part of the graph: each call drops different weights,
    ``torch.manual_seed`` repeats a call, and the gradients flow."""
    import cukern.torch as ct

    q, k, v, do = _torch_qkv(1, 160, 4, 4, 64)
    f = torch.compile(lambda q, k, v: ct.flash_attn_func(q, k, v, dropout_p=0.3, causal=True), fullgraph=True)
    torch.manual_seed(5)
    a = f(q, k, v)
    torch.manual_seed(5)
    b = f(q, k, v)
    c = f(q, k, v)
    assert torch.equal(a, b) and not torch.equal(a, c)
    plain = ct.flash_attn_func(q, k, v, causal=True)
    assert (a.float() - plain.float()).abs().max() > 0.05
    grads = torch.autograd.grad(a, (q, k, v), do)
    assert all(bool(torch.isfinite(t).all()) and t.abs().max() > 0 for t in grads)


@needs_torch
def test_the_drop_ins_take_dropout_where_hoppers_kernels_draw_it(monkeypatch):
    """The SDPA drop-in and ``patch(model)`` take dropout where it measured faster than
    PyTorch's: on Hopper at head dims 64 and 128 (q's and v's alike); elsewhere a reason."""
    from cukern.attention import torch as at

    monkeypatch.setattr(at, "_hopper", lambda device: True)
    dev = torch.device("cuda", 0)
    assert at.dropout_route_reason(dev, 64, 64) is None and at.dropout_route_reason(dev, 128, 128) is None
    assert at.dropout_route_reason(dev, 256, 256) == "dropout at head_dim 256"
    assert at.dropout_route_reason(dev, 192, 128) == "dropout at head_dim 192"
    monkeypatch.setattr(at, "_hopper", lambda device: False)
    assert at.dropout_route_reason(dev, 64, 64) == "dropout off Hopper"
