"""The deterministic attention backward: on Hopper, dQ's reduce-adds into each query tile take
turns in a fixed order of the key blocks (the kernel's ORDERED instances); elsewhere, and where
that order cannot be kept, dQ has its own pass. Every case: the same bits on repeated calls,
the reference's values, and the path it took."""
from __future__ import annotations

import importlib

import numpy as np
import pytest

from cukern import reference as ref

from attention_grads import gradient_scales

attn = importlib.import_module("cukern.attention")
gpu = pytest.mark.gpu


# ---- which instance a deterministic backward takes (CPU) -----------------------------------------

@pytest.mark.parametrize("rows, d, orders", [(64, 128, True), (128, 64, True), (64, 64, False)])
def test_turns_need_each_warp_to_add_its_own_part(rows, d, orders):
    """64 x 128 and 128 x 64 dQ tiles split between the warpgroups (each warp adds its own 16
    rows); 64 x 64 tiles are added by both warpgroups into the same elements: no turns."""
    cfg = attn.Sm90BwdConfig(rows, producer=True)
    assert cfg.orders(d, 1, 10, 132) is orders


@pytest.mark.parametrize("mask", [0, 1, 2])
def test_unmasked_turns_need_a_group_resident(mask):
    """Without a mask a group's key blocks wait on each other in walk order, so they must all be
    resident; with a mask the highest key block goes first and launches first."""
    cfg = attn.Sm90BwdConfig(64, producer=True)
    assert cfg.orders(128, mask, 132, 132)
    assert cfg.orders(128, mask, 133, 132) is (mask != 0)


def test_the_ordered_instance_adds_dq_with_a_producer():
    cfg = attn.Sm90BwdConfig(64, producer=True, persistent=True)
    det = cfg.instance("bfloat16", 128, 0, True)
    ordered = cfg.instance("bfloat16", 128, 0, True, ordered=True)
    fast = cfg.instance("bfloat16", 128, 0, False)
    assert det.name.endswith(", false, false>") and fast.name.endswith(", false, false>")
    assert ordered.name.endswith(", true, false>")   # (ordered, no dropout)
    assert ordered.threads == fast.threads == 384 and det.threads == 256
    assert ordered.smem == fast.smem > det.smem
    # (the default's template arguments but the two before the last: not persistent, ordered)
    assert ordered.template_args[:-3] == fast.template_args[:-3]
    assert fast.template_args[-3:-1] == ("true", "false") and ordered.template_args[-3:-1] == ("false", "true")
    assert not attn.Sm90BwdConfig(64).orders(128, 1, 10, 132)   # (no producer warpgroup to add)
    # ordered only with deterministic
    assert cfg.instance("bfloat16", 128, 0, False, ordered=True) == fast


def test_every_ordered_instance_is_compiled_by_the_check():
    names = [i.name for i in attn.configs.instances() if i.name.startswith("attention_bwd_sm90<")]
    ordered = [n for n in names if n.endswith(", true, false>")]   # (without dropout)
    # (bf16 and fp16) x (64, 128) x 3 masks x dense/packed, but d64's packed unmasked one, and
    # the softcap's d128 alone
    assert len(ordered) == 2 * (2 * 3 * 2 - 1 + 3 * 2)
    assert not attn.Sm90BwdConfig(128, producer=True).orders(64, 0, 2, 132, varlen=True)


# ---- the GPU -------------------------------------------------------------------------------------

CASES = [
    # (b, sq, sk, h, hkv, d, causal, window, softcap): unmasked, M != N, GQA; causal with Sq > Sk
    # and Sq < Sk; a window, and one open to the right; the softcap; d64 softcap (no turns)
    dict(b=2, sq=1024, sk=1024, h=4, hkv=2, d=128),
    dict(b=1, sq=700, sk=1500, h=2, hkv=1, d=64),
    dict(b=1, sq=1500, sk=600, h=4, hkv=4, d=128),
    dict(b=2, sq=1024, sk=1024, h=4, hkv=1, d=128, causal=True),
    dict(b=1, sq=1300, sk=900, h=2, hkv=2, d=64, causal=True),
    dict(b=1, sq=600, sk=1300, h=2, hkv=1, d=128, causal=True),
    dict(b=1, sq=1024, sk=1024, h=2, hkv=2, d=128, window=(300, 40)),
    dict(b=1, sq=800, sk=1000, h=2, hkv=1, d=64, window=(200, -1)),
    dict(b=1, sq=900, sk=1100, h=2, hkv=1, d=128, softcap=20.0),
    dict(b=1, sq=900, sk=1100, h=2, hkv=1, d=64, softcap=20.0, causal=True),
]


def _hopper_or_skip():
    from cukern import _kernels

    if _kernels.compute_capability(0) != (9, 0):
        pytest.skip("the ordered adds are the Hopper kernel's")


def _recording(mp):
    """The names of the instances the backward's next plans launch (fresh plan caches)."""
    from cukern import _kernels, _plans

    bwd = importlib.import_module("cukern.attention.backward")
    names: list[str] = []
    real = _kernels.kernel

    def kernel(instance, device):
        names.append(instance.name)
        return real(instance, device)

    mp.setattr(_kernels, "kernel", kernel)
    mp.setattr(bwd, "_BWD", _plans.PlanCache())
    mp.setattr(bwd, "_BWD_VARLEN", _plans.PlanCache())
    return names


@gpu
@pytest.mark.parametrize("c", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_deterministic_backward_repeats_its_bits_and_matches_the_reference(c, dtype):
    import cukern
    from arrays import assert_close, random_host, to_device, to_host

    _hopper_or_skip()
    c = dict(dict(causal=False, window=(-1, -1), softcap=0.0), **c)
    rng = np.random.default_rng(sum(v for v in c.values() if isinstance(v, int)))
    q = random_host(rng, (c["b"], c["sq"], c["h"], c["d"]), dtype, scale=2.0)
    k = random_host(rng, (c["b"], c["sk"], c["hkv"], c["d"]), dtype, scale=2.0)
    v = random_host(rng, (c["b"], c["sk"], c["hkv"], c["d"]), dtype)
    do = random_host(rng, q.shape, dtype)
    kw = dict(causal=c["causal"], window=c["window"], softcap=c["softcap"])
    qd, kd, vd, dod = (to_device(a, "torch" if dtype == "float16" else "cupy") for a in (q, k, v, do))
    out, lse = cukern.attention(qd, kd, vd, return_lse=True, **kw)
    with pytest.MonkeyPatch.context() as mp:
        names = _recording(mp)
        runs = [[to_host(g) for g in cukern.attention_backward(dod, qd, kd, vd, out, lse, deterministic=True,
                                                               **kw)] for _ in range(4)]
    main = [n for n in names if n.startswith("attention_bwd_sm90<")]
    assert len(main) == 1
    in_turns = c["d"] * (64 if c["d"] == 128 else 128) == 2 * 64 * 64 and not (c["d"] == 64 and c["softcap"])
    assert main[0].endswith(", true, false>") is in_turns, main[0]
    assert any(n.startswith("attention_bwd_dq<") for n in names) is not in_turns
    assert all(_bits(r) == _bits(runs[0]) for r in runs[1:]), "deterministic=True must give the same bits every call"
    grads = runs[0]
    expect = ref.attention_backward(do, q, k, v, **kw)
    scales = gradient_scales(do, q, k, v, c["causal"], None, c["window"], c["softcap"])
    tol = 2 * ({"float16": 4e-3, "bfloat16": 2e-2}[dtype] + c["softcap"] * 2.0 ** -11)
    for name, got, e, sc in zip(("dq", "dk", "dv"), grads, expect, scales):
        assert_close(got, e, dtype, name, tol=tol, scale=sc)
    # the default (atomic) backward: the same dq but for the order of its float32 sums
    fast = cukern.attention_backward(dod, qd, kd, vd, out, lse, **kw)
    assert_close(fast[0], grads[0], dtype, "dq (default against deterministic)", tol=tol,
                 scale=scales[0])


@gpu
@pytest.mark.parametrize("causal, window", [(False, (-1, -1)), (True, (-1, -1)), (False, (150, 30))])
def test_packed_documents_take_turns_in_their_own_tiles(causal, window):
    """Packed documents of several key blocks each (and one shorter than a tile): each
    document's tiles have their own turns; bits repeated, values the reference's."""
    import cupy

    import cukern
    from arrays import assert_close, random_host, to_host

    _hopper_or_skip()
    rng = np.random.default_rng(7 + causal + window[0])
    lq, lk = [700, 90, 1100], [900, 90, 600]
    cu_q, cu_k = np.cumsum([0, *lq]).astype(np.int32), np.cumsum([0, *lk]).astype(np.int32)
    q = random_host(rng, (sum(lq), 4, 128), "bfloat16", scale=2.0)
    k, v = (random_host(rng, (sum(lk), 2, 128), "bfloat16", scale=s) for s in (2.0, 1.0))
    do = random_host(rng, q.shape, "bfloat16")
    dev = [cupy.asarray(a) for a in (q, k, v, do, cu_q, cu_k)]
    kw = dict(causal=causal, window=window)
    out, lse = cukern.attention_varlen(*dev[:3], dev[4], dev[5], max(lq), max(lk), return_lse=True, **kw)
    with pytest.MonkeyPatch.context() as mp:
        names = _recording(mp)
        runs = [[to_host(g) for g in cukern.attention_varlen_backward(
            dev[3], *dev[:3], out, lse, dev[4], dev[5], max(lq), max(lk), deterministic=True, **kw)]
            for _ in range(3)]
    assert [n for n in names if n.startswith("attention_bwd_sm90<")][0].endswith(", true, false>")
    assert _bits(runs[1]) == _bits(runs[0]) == _bits(runs[2])
    expect = ref.attention_varlen_backward(do, q, k, v, None, None, cu_q, cu_k, max(lq), max(lk), **kw)
    for i, (name, e) in enumerate(zip(("dq", "dk", "dv"), expect)):
        got = runs[0][i]
        for (q0, q1), (k0, k1) in zip(zip(cu_q[:-1], cu_q[1:]), zip(cu_k[:-1], cu_k[1:])):
            a, z = (q0, q1) if name == "dq" else (k0, k1)
            sc = gradient_scales(do[None, q0:q1], q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal, None, window)
            assert_close(got[a:z], e[a:z], "bfloat16", f"{name} of document {q0}:{q1}", tol=4e-2,
                         scale=sc[("dq", "dk", "dv").index(name)])


@gpu
def test_a_group_with_more_key_blocks_than_the_sms_takes_the_dq_pass():
    """A device of two SMs, as the plan sees it: an unmasked group's key blocks cannot all be
    resident, so the deterministic backward leaves dQ to its own pass; bits still repeat."""
    import cupy

    import cukern
    from arrays import assert_close, random_host, to_host

    _hopper_or_skip()
    rng = np.random.default_rng(3)
    q, k, v, do = (cupy.asarray(random_host(rng, (1, 700, 2, 128), "bfloat16")) for _ in range(4))
    out, lse = cukern.attention(q, k, v, return_lse=True)
    from cukern import _kernels

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_kernels, "sm_count", lambda device: 2)
        names = _recording(mp)
        runs = [[to_host(g) for g in cukern.attention_backward(do, q, k, v, out, lse, deterministic=True)]
                for _ in range(2)]
    assert any(n.startswith("attention_bwd_dq<") for n in names)
    assert _bits(runs[0]) == _bits(runs[1])
    fast = cukern.attention_backward(do, q, k, v, out, lse)
    assert_close(fast[0], runs[0][0], "bfloat16", "dq (default against deterministic)", tol=4e-2)


def _bits(grads) -> list[bytes]:
    """The gradients' bits (float64 copies of 16-bit values: one to one, the sign of zero kept)."""
    return [np.ascontiguousarray(g).tobytes() for g in grads]
