"""Head dim 256's Hopper backward (attention_bwd_sm90_d256, on unless
``Configs.use_sm90_bwd_d256`` is off): the plan it takes, and its gradients against the NumPy reference
(masks, the softcap, GQA, lengths off the 64-row tiles, both dtypes)."""
from __future__ import annotations

import dataclasses
import importlib

import numpy as np
import pytest

from cukern import reference as ref

from attention_grads import gradient_scales

attn = importlib.import_module("cukern.attention")
gpu = pytest.mark.gpu


def _configs(on: bool = True):
    return dataclasses.replace(attn.configs.CONFIGS, use_sm90_bwd_d256=on)


def test_the_d256_kernel_fits_a_block_and_is_in_the_compile_check():
    cfg = attn.configs.CONFIGS.bwd_sm90_d256
    assert cfg.smem() <= 227 * 1024
    inst = cfg.instance("bfloat16", 1, True)
    assert inst.name == f"attention_bwd_sm90_d256<cuk::bf16, 1, true, false, {cfg.smem()}>"
    assert inst.threads == 384 and inst.arch == "sm_90a"
    ordered = cfg.instance("float16", 0, False, ordered=True)
    assert ordered.name == f"attention_bwd_sm90_d256<cuk::half, 0, false, true, {cfg.smem()}>"
    assert ordered.threads == 384 and ordered.smem == inst.smem
    names = {i.name for i in attn.configs.instances()}
    assert {cfg.instance(dt, m, c, o).name for dt in ("bfloat16", "float16") for m in (0, 1, 2)
            for c in (False, True) for o in (False, True)} <= names


@pytest.mark.parametrize("mask", [0, 1, 2])
def test_unmasked_turns_need_a_group_resident(mask):
    """Without a mask a group's key blocks wait on each other in walk order, so all must be
    resident; with a mask the highest key block goes first and is launched first."""
    cfg = attn.configs.CONFIGS.bwd_sm90_d256
    assert cfg.orders(mask, 66, 66)
    assert cfg.orders(mask, 67, 66) is (mask != 0)


def test_the_plan_takes_the_d256_kernel_where_switched_on(host_arrays_as_device, monkeypatch):
    import cukern
    from cukern import _kernels

    from conftest import DryRun

    monkeypatch.setattr(_kernels, "compute_capability", lambda device: (9, 0))

    def plan(causal=True, **kw):
        attn._BWD.clear()
        q = np.ones((2, 200, 4, 256), np.float16)
        kv = np.ones((2, 300, 2, 256), np.float16)
        lse = np.zeros((2, 4, 200), np.float32)
        with pytest.raises(DryRun) as info:
            cukern.attention_backward(q, q, kv, kv, q, lse, causal=causal, **kw)
        return info.value.plan

    def launches(**kw):
        return [s for s in plan(**kw).steps if isinstance(s, tuple) and s[0] == "launch"]

    def names(**kw):
        return [s[1].name.split("<")[0] for s in launches(**kw)]

    monkeypatch.setattr(attn.configs, "CONFIGS", _configs(True))
    assert names() == ["attention_bwd_dot", "attention_bwd_sm90_d256", "attention_bwd_dq_convert"]
    steps = launches()
    assert steps[1][1].name.endswith(", false, 231424>") and steps[1][2] == (5, 4)   # (key blocks, groups)
    # deterministic: the ordered instance, a zeroed int32 turn counter a (batch, head, tile)
    steps = launches(deterministic=True)
    assert [s[1].name.split("<")[0] for s in steps] == names()
    assert steps[1][1].name.endswith(", true, 231424>") and steps[1][2] == (5, 4)
    turns = [a for a in plan(deterministic=True).allocs if a.dtype == "int32"]
    assert [t.shape for t in turns] == [(2, 4, 4)]
    # ... unmasked too, while a group's 5 key blocks are resident (half the SMs); beyond that the
    # sm_80 kernel and dQ's own pass
    monkeypatch.setattr(_kernels, "sm_count", lambda device: 10)
    assert launches(causal=False, deterministic=True)[1][1].name.endswith(", true, 231424>")
    monkeypatch.setattr(_kernels, "sm_count", lambda device: 8)
    assert names(causal=False, deterministic=True) == ["attention_bwd_dot", "attention_bwd_dkdv", "attention_bwd_dq"]
    assert names(causal=True, deterministic=True)[1] == "attention_bwd_sm90_d256"
    monkeypatch.setattr(attn.configs, "CONFIGS", _configs(False))
    assert names()[1] == "attention_bwd_dkdv"
    attn._BWD.clear()


CASES = [
    dict(b=2, sq=256, sk=256, h=4, hkv=2),
    dict(b=1, sq=200, sk=330, h=2, hkv=1, causal=True),
    dict(b=1, sq=330, sk=130, h=2, hkv=2, causal=True),
    dict(b=2, sq=190, sk=190, h=2, hkv=1, window=(70, 10)),
    dict(b=1, sq=257, sk=257, h=3, hkv=3, causal=True, softcap=30.0),
    dict(b=1, sq=1, sk=65, h=2, hkv=2),
]


def _gpu_inputs(c, dtype, seed):
    """Case ``c`` filled in, its random inputs on the host and on the device (torch for float16,
    CuPy for bfloat16), the mask's arguments, the framework, and the forward's out and lse; skips
    off Hopper."""
    import cukern
    from arrays import random_host, to_device
    from cukern import _kernels

    if _kernels.compute_capability(0) != (9, 0):
        pytest.skip("the d256 Hopper kernel needs an sm_90 GPU")
    c = dict(dict(causal=False, window=(-1, -1), softcap=0.0), **c)
    rng = np.random.default_rng(seed)
    q = random_host(rng, (c["b"], c["sq"], c["h"], 256), dtype, scale=2.0)
    k = random_host(rng, (c["b"], c["sk"], c["hkv"], 256), dtype, scale=2.0)
    v = random_host(rng, (c["b"], c["sk"], c["hkv"], 256), dtype)
    do = random_host(rng, q.shape, dtype)
    kw = dict(causal=c["causal"], window=c["window"], softcap=c["softcap"])
    fw = "torch" if dtype == "float16" else "cupy"
    dev = tuple(to_device(a, fw) for a in (q, k, v, do))
    out, lse = cukern.attention(*dev[:3], return_lse=True, **kw)
    return c, (q, k, v, do), dev, kw, fw, out, lse


@gpu
@pytest.mark.parametrize("c", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_d256_backward_matches_the_reference(c, dtype):
    import cukern
    from arrays import assert_close, poison_allocator

    c, (q, k, v, do), (qd, kd, vd, dod), kw, fw, out, lse = _gpu_inputs(c, dtype, c["sq"] * 7 + c["sk"])
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attn.configs, "CONFIGS", _configs(True))
        poison_allocator(fw, [q.nbytes, k.nbytes, k.nbytes])
        grads = cukern.attention_backward(dod, qd, kd, vd, out, lse, **kw)
    expect = ref.attention_backward(do, q, k, v, **kw)
    scales = gradient_scales(do, q, k, v, c["causal"], None, c["window"], c["softcap"])
    tol = 2 * ({"float16": 4e-3, "bfloat16": 2e-2}[dtype] + c["softcap"] * 2.0 ** -11)
    for name, got, e, sc in zip(("dq", "dk", "dv"), grads, expect, scales):
        assert_close(got, e, dtype, name, tol=tol, scale=sc)
    cukern.check_errors()


DETERMINISTIC_CASES = CASES + [
    # more key blocks a group: causal with GQA, unmasked with Sq > Sk (rotated walks), a window
    # open to the right
    dict(b=1, sq=1000, sk=1000, h=4, hkv=2, causal=True),
    dict(b=1, sq=900, sk=700, h=2, hkv=1),
    dict(b=1, sq=800, sk=1000, h=2, hkv=1, window=(200, -1)),
]


@gpu
@pytest.mark.parametrize("c", DETERMINISTIC_CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_d256_deterministic_backward_repeats_its_bits_and_matches_the_reference(c, dtype):
    """deterministic=True: the ordered instance (dQ's adds in turns), the same bits on every
    call, the reference's values, and the default's dq but for the order of its sums."""
    import cukern
    from arrays import assert_close, to_host
    from cukern import _kernels

    c, (q, k, v, do), (qd, kd, vd, dod), kw, fw, out, lse = _gpu_inputs(c, dtype, c["sq"] * 5 + c["sk"] + c["h"])
    seen = []
    real = _kernels.kernel
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attn.configs, "CONFIGS", _configs(True))
        mp.setattr(_kernels, "kernel", lambda inst, device: seen.append(inst.name) or real(inst, device))
        attn._BWD.clear()
        runs = [[to_host(g) for g in cukern.attention_backward(dod, qd, kd, vd, out, lse, deterministic=True, **kw)]
                for _ in range(3)]
    attn._BWD.clear()
    (main,) = [n for n in seen if n.startswith("attention_bwd_sm90_d256<")]
    assert main.endswith(", true, 231424>") and not any(n.startswith("attention_bwd_dq<") for n in seen), seen
    fast = cukern.attention_backward(dod, qd, kd, vd, out, lse, **kw)
    bits = [[np.ascontiguousarray(g).tobytes() for g in r] for r in runs]
    assert bits[1] == bits[0] == bits[2], "deterministic=True must give the same bits every call"
    expect = ref.attention_backward(do, q, k, v, **kw)
    scales = gradient_scales(do, q, k, v, c["causal"], None, c["window"], c["softcap"])
    tol = 2 * ({"float16": 4e-3, "bfloat16": 2e-2}[dtype] + c["softcap"] * 2.0 ** -11)
    for name, got, e, sc in zip(("dq", "dk", "dv"), runs[0], expect, scales):
        assert_close(got, e, dtype, name, tol=tol, scale=sc)
    assert_close(fast[0], runs[0][0], dtype, "dq (default against deterministic)", tol=tol, scale=scales[0])
