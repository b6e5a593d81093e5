"""Head dim 256's Hopper backward (attention_bwd_sm90_d256, switched on by
``Configs.use_sm90_bwd_d256``): the plan it takes, and its gradients against the NumPy reference
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
    assert inst.name == f"attention_bwd_sm90_d256<cuk::bf16, 1, true, {cfg.smem()}>"
    assert inst.threads == 384 and inst.arch == "sm_90a"
    names = {i.name for i in attn.configs.instances()}
    assert {cfg.instance(dt, m, c).name for dt in ("bfloat16", "float16") for m in (0, 1, 2)
            for c in (False, True)} <= names


def test_the_plan_takes_the_d256_kernel_where_switched_on(host_arrays_as_device, monkeypatch):
    import cukern
    from cukern import _kernels

    from conftest import DryRun

    monkeypatch.setattr(_kernels, "compute_capability", lambda device: (9, 0))

    def names(**kw):
        attn._BWD.clear()
        q = np.ones((2, 200, 4, 256), np.float16)
        kv = np.ones((2, 300, 2, 256), np.float16)
        lse = np.zeros((2, 4, 200), np.float32)
        with pytest.raises(DryRun) as info:
            cukern.attention_backward(q, q, kv, kv, q, lse, causal=True, **kw)
        return [s[1].name.split("<")[0] for s in info.value.plan.steps if isinstance(s, tuple) and s[0] == "launch"]

    monkeypatch.setattr(attn.configs, "CONFIGS", _configs(True))
    assert names() == ["attention_bwd_dot", "attention_bwd_sm90_d256", "attention_bwd_dq_convert"]
    # deterministic keeps the sm_80 kernel and dQ's pass
    assert names(deterministic=True) == ["attention_bwd_dot", "attention_bwd_dkdv", "attention_bwd_dq"]
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


@gpu
@pytest.mark.parametrize("c", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_d256_backward_matches_the_reference(c, dtype):
    import cukern
    from arrays import assert_close, poison_allocator, random_host, to_device
    from cukern import _kernels

    if _kernels.compute_capability(0) != (9, 0):
        pytest.skip("the d256 Hopper kernel needs an sm_90 GPU")
    c = dict(dict(causal=False, window=(-1, -1), softcap=0.0), **c)
    rng = np.random.default_rng(c["sq"] * 7 + c["sk"])
    q = random_host(rng, (c["b"], c["sq"], c["h"], 256), dtype, scale=2.0)
    k = random_host(rng, (c["b"], c["sk"], c["hkv"], 256), dtype, scale=2.0)
    v = random_host(rng, (c["b"], c["sk"], c["hkv"], 256), dtype)
    do = random_host(rng, q.shape, dtype)
    kw = dict(causal=c["causal"], window=c["window"], softcap=c["softcap"])
    fw = "torch" if dtype == "float16" else "cupy"
    qd, kd, vd, dod = (to_device(a, fw) for a in (q, k, v, do))
    out, lse = cukern.attention(qd, kd, vd, return_lse=True, **kw)
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
