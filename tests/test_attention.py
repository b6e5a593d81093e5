"""Fused attention forward: the reference (no GPU), argument checking, and the kernel against
the float64 reference and torch's scaled_dot_product_attention (GPU)."""
from __future__ import annotations

import dataclasses
import importlib
import os

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import cukern
from cukern import reference as ref
from conftest import DryRun

from arrays import assert_close, poison_allocator, random_host, to_device, to_host, torch
from attention_grads import gradient_scales

gpu = pytest.mark.gpu
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")
FRAMEWORKS = ["cupy", "torch"] if torch is not None else ["cupy"]
ATTN_DTYPES = ("float16", "bfloat16")
# P is rounded to the dtype before P·V (as FlashAttention): a few roundings of the dtype.
TOL = {"float16": 4e-3, "bfloat16": 2e-2}


# ---- the reference, no GPU ----------------------------------------------------------------------

def _torch_sdpa(q, k, v, causal, scale):
    """torch float64 on the CPU, causal aligned to the bottom right through an explicit mask."""
    qt, kt, vt = (torch.tensor(a).transpose(1, 2) for a in (q, k, v))
    rep = qt.shape[1] // kt.shape[1]
    kt, vt = kt.repeat_interleave(rep, 1), vt.repeat_interleave(rep, 1)
    sq, sk = qt.shape[2], kt.shape[2]
    mask = torch.tensor(np.arange(sk)[None, :] <= np.arange(sq)[:, None] + (sk - sq)) if causal else None
    s = (qt @ kt.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask, -float("inf"))
    return torch.softmax(s, -1) @ vt, torch.logsumexp(s, -1)


@needs_torch
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq, sk, h, hkv", [(5, 7, 4, 2), (9, 9, 3, 3), (6, 4, 4, 1), (1, 13, 2, 2)])
def test_reference_matches_torch_cpu_float64(sq, sk, h, hkv, causal):
    rng = np.random.default_rng(sq * 100 + sk)
    q = rng.standard_normal((2, sq, h, 16))
    k, v = rng.standard_normal((2, sk, hkv, 16)), rng.standard_normal((2, sk, hkv, 16))
    out, lse = ref.attention(q, k, v, causal=causal, softmax_scale=0.3, return_lse=True)
    o_t, lse_t = _torch_sdpa(q, k, v, causal, 0.3)
    seen = np.isfinite(lse_t.numpy())
    rows = np.broadcast_to(seen.transpose(0, 2, 1)[..., None], out.shape)  # queries that see a key
    np.testing.assert_allclose(out[rows], o_t.transpose(1, 2).numpy()[rows], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse[seen], lse_t.numpy()[seen], rtol=1e-12, atol=1e-12)


def test_reference_rows_that_see_no_key():
    """Causal with Sq > Sk: the first Sq - Sk queries see no key: zeros and lse = +inf."""
    rng = np.random.default_rng(1)
    q, k, v = rng.standard_normal((1, 6, 1, 8)), rng.standard_normal((1, 2, 1, 8)), rng.standard_normal((1, 2, 1, 8))
    out, lse = ref.attention(q, k, v, causal=True, return_lse=True)
    assert np.all(out[0, :4] == 0) and np.all(np.isinf(lse[0, 0, :4]))
    assert np.all(np.isfinite(lse[0, 0, 4:]))


# ---- argument checking that needs no GPU ------------------------------------------------------

def test_host_arrays_are_a_type_error():
    x = np.ones((1, 4, 2, 64), np.float16)
    with pytest.raises(TypeError, match=r"^q: .*host"):
        cukern.attention(x, x, x)


def test_argument_checks_without_a_gpu(host_arrays_as_device):
    """Every check of attention and attention_backward that precedes the launch, on CPU."""
    bf16 = ml_bf16()
    q = np.ones((2, 8, 4, 64), np.float16)
    kv = np.ones((2, 8, 2, 64), np.float16)
    lse = np.zeros((2, 4, 8), np.float32)
    fwd = [
        ((q.astype(np.float32), kv, kv), {}, ValueError, r"^q: float32 is not supported"),
        ((q[0], kv, kv), {}, ValueError, r"^q: expected \(batch, seqlen, heads, head_dim\)"),
        ((q, kv.astype(bf16), kv), {}, ValueError, "^k: dtype bfloat16 differs from q's float16"),
        ((q, kv, kv[:, :4]), {}, ValueError, "^v: shape"),
        ((q, kv[:1], kv[:1]), {}, ValueError, "^k: batch 1 does not match q's 2"),
        ((q, kv[..., :32], kv[..., :32]), {}, ValueError, "^k: head_dim 32 does not match q's 64"),
        ((q, np.ones((2, 8, 3, 64), np.float16), np.ones((2, 8, 3, 64), np.float16)), {}, ValueError,
         "^k: 3 kv heads do not divide q's 4 heads"),
        ((q[..., :48], kv[..., :48], kv[..., :48]), {}, ValueError, "^q: head_dim 48 is not supported"),
        ((q, kv, kv), {"softmax_scale": -1.0}, ValueError, "^softmax_scale: must be finite and positive"),
        ((q, kv, kv), {"softmax_scale": "x"}, TypeError, "^softmax_scale: expected a number"),
        ((q, kv, kv), {"softmax_scale": 1e-46}, ValueError, "^softmax_scale: .* outside float32's normal range"),
        ((q, kv, kv), {"softmax_scale": 3e38}, ValueError, "^softmax_scale: .* outside float32's normal range"),
        ((np.ones((1, 2, 70000, 64), np.float16), np.ones((1, 2, 1, 64), np.float16),
          np.ones((1, 2, 1, 64), np.float16)), {}, ValueError, "^q: batch \\* heads = 70000 exceeds 65535"),
    ]
    for args, kw, exc, pattern in fwd:
        with pytest.raises(exc, match=pattern):
            cukern.attention(*args, **kw)
    bwd = [
        ((q[:, :4], q, kv, kv, q, lse), ValueError, "^dout: shape"),
        ((q, q, kv, kv, q.astype(bf16), lse), ValueError, "^out: dtype bfloat16 differs"),
        ((q, q, kv, kv, q, lse[:, :2]), ValueError, r"^lse: shape \(2, 2, 8\)"),
        ((q, q, kv, kv, q, lse.astype(np.float16)), ValueError, "^lse: dtype float16"),
        ((q, q, kv, kv, q, None), TypeError, "^lse: required"),
        ((q, q, kv[:1], kv[:1], q, lse), ValueError, "^k: batch 1 does not match"),
        ((*(np.ones((1, 4, 2, 80), np.float16) for _ in range(5)), np.zeros((1, 2, 4), np.float32)),
         ValueError, "^q: head_dim 80 is not supported by the backward"),
    ]
    for args, exc, pattern in bwd:
        with pytest.raises(exc, match=pattern):
            cukern.attention_backward(*args)


def test_misaligned_contiguous_views_are_copied(host_arrays_as_device):
    """A contiguous view that starts off a 16-byte boundary (a slice of a flat buffer) must be
    read through a fresh, aligned copy: contiguous() would hand back the same address."""
    from cukern._arrays import DeviceArray

    buf = np.ones(2 * 8 * 4 * 64 + 8, np.float16)
    q = buf[1:1 + 2 * 8 * 4 * 64].reshape(2, 8, 4, 64)   # 2 bytes past an aligned start
    assert q.ctypes.data % 16 and q.flags.c_contiguous
    kv = np.ones((2, 8, 2, 64), np.float16)
    with pytest.raises(DryRun) as info:
        cukern.attention(q, kv, kv)
    assert info.value.plan.fixes == ((0, DeviceArray.copy),)
    with pytest.raises(DryRun) as info:   # aligned: read in place, no copy
        cukern.attention(q.copy(), kv, kv)
    assert info.value.plan.fixes == ()


@pytest.mark.parametrize("which", ["kv", "q"])
def test_gradients_of_broadcast_inputs_are_written_densely(host_arrays_as_device, which):
    """K and V (or q) expanded over the heads (stride 0) are read in place; their gradients are
    written in a dense layout with a unit-stride head dim: every element once, each pair of
    columns of a 4-byte store aligned (an output laid out with the broadcast axis innermost had
    dk's columns 2 apart and stores at odd addresses)."""
    d = 64
    q = np.ones((2, 131, 4, d), np.float16)
    kv = np.ones((2, 131, 2, d), np.float16)
    if which == "kv":
        kv = np.broadcast_to(np.ones((2, 131, 1, d), np.float16), (2, 131, 2, d))
    else:
        q = np.broadcast_to(np.ones((2, 131, 1, d), np.float16), (2, 131, 4, d))
    lse = np.zeros((2, 4, 131), np.float32)
    with pytest.raises(DryRun) as info:
        cukern.attention_backward(q, q, kv, kv, q, lse, causal=True)
    args = {}
    for s in info.value.plan.steps:
        if isinstance(s, tuple) and s[0] == "launch":
            args.update(s[4])
    for name, shape in (("dk", kv.shape), ("dv", kv.shape), ("dq", q.shape)):
        if f"{name}_sb" not in args:
            continue
        sb, ss, sh = args[f"{name}_sb"], args[f"{name}_ss"], args[f"{name}_sh"]
        b, s_, h, dd = np.meshgrid(*(np.arange(n) for n in shape), indexing="ij")
        offsets = np.sort((b * sb + s_ * ss + h * sh + dd).ravel())
        assert np.array_equal(offsets, np.arange(int(np.prod(shape)))), f"{name}: strides {(sb, ss, sh)}"
        assert sb % 2 == ss % 2 == sh % 2 == 0, f"{name}: strides {(sb, ss, sh)}"


def test_the_sm90_forward_takes_tensor_maps_of_the_inputs(host_arrays_as_device, monkeypatch):
    """With the Hopper path on (Configs.use_sm90), an sm_90 device runs attention_fwd_sm90 with
    tensor maps made per call from q, k and v (boxes of 128 query rows, bn keys, 64 columns);
    other devices and head dims keep attention_fwd."""
    import importlib

    from cukern import _kernels

    attn = importlib.import_module("cukern.attention")
    shipped = attn.configs.CONFIGS
    monkeypatch.setattr(attn.configs, "CONFIGS", attn.Configs(shipped.fwd, shipped.bwd, shipped.dq, use_sm90=True))

    def launches(d, cc):
        monkeypatch.setattr(_kernels, "compute_capability", lambda device: cc)
        attn._FWD.clear()   # (plans assume one device: the capability is not in their key)
        q, kv = np.ones((2, 200, 4, d), np.float16), np.ones((2, 300, 2, d), np.float16)
        with pytest.raises(DryRun) as info:
            cukern.attention(q, kv, kv, causal=True)
        return [s for s in info.value.plan.steps if isinstance(s, tuple) and s[0] == "launch"]

    (step,) = launches(128, (9, 0))
    _, inst, grid, _, _, slots = step
    # (causal d128: persistent, 2 x 4 x 2 work tiles for fewer SMs than that; O written by TMA too)
    assert inst.name.startswith("attention_fwd_sm90<cuk::half, 128, 128, 128, 3, 2, 1, false, true, true, true, true, ")
    assert inst.arch == "sm_90a" and inst.threads == 384 and grid == (min(16, _kernels.sm_count(0)), 1)
    maps = [(m.index, m.box) for _, m, _ in slots if isinstance(m, _kernels.MapSlot)]
    assert maps == [(0, (1, 128, 1, 64)), (1, (1, 128, 1, 64)), (2, (1, 128, 1, 64)), (3, (1, 64, 1, 64))]
    # (d256: 80-key tiles, FlashAttention-4's)
    assert [m.box for _, m, _ in launches(256, (9, 0))[0][5] if isinstance(m, _kernels.MapSlot)][1] == (1, 80, 1, 64)
    assert launches(128, (8, 0))[0][1].name.startswith("attention_fwd<")   # A100
    # K and V expanded over the heads (stride 0): no tensor map describes them, the sm_80 kernel does
    monkeypatch.setattr(_kernels, "compute_capability", lambda device: (9, 0))
    attn._FWD.clear()
    q, kv = np.ones((2, 200, 4, 128), np.float16), np.ones((2, 300, 1, 128), np.float16)
    with pytest.raises(DryRun) as info:
        cukern.attention(q, np.broadcast_to(kv, (2, 300, 4, 128)), np.broadcast_to(kv, (2, 300, 4, 128)))
    assert [s[1].name for s in info.value.plan.steps if isinstance(s, tuple)][0].startswith("attention_fwd<")
    assert launches(96, (9, 0))[0][1].name.startswith("attention_fwd<")    # no Hopper config
    attn._FWD.clear()


def test_the_sm90_forward_config_by_head_dim_and_mask():
    """The forward without a causal mask may have its own Hopper config (d128: no turns between
    the warpgroups); causal, and head dims without one, take fwd_sm90's. Each is compiled by the
    check."""
    import importlib

    attn = importlib.import_module("cukern.attention")
    cfgs = attn.configs.CONFIGS
    for d, full in cfgs.fwd_sm90_full:
        assert cfgs.sm90_forward(d, False) == full and cfgs.sm90_forward(d, True) == cfgs.get("fwd_sm90", d)
        assert full.instance("float16", d, False, dv=cfgs.dv(d)).name in {i.name for i in attn.instances()}
    assert cfgs.sm90_forward(64, False) == cfgs.get("fwd_sm90", 64)
    assert not cfgs.sm90_forward(128, False).pingpong and cfgs.sm90_forward(128, True).pingpong
    assert cfgs.sm90_forward(128, False).persistent and cfgs.sm90_forward(128, True).persistent
    assert cfgs.sm90_forward(256, False) == cfgs.get("fwd_sm90", 256)
    with pytest.raises(ValueError, match="warpgroups=3 takes value head sizes up to 128, not 256"):
        attn.Sm90FwdConfig(64, warpgroups=3).instance("bfloat16", 256, False)
    # (MLA: Q and K tiles of 192 columns, V's and O's of 128; three warpgroups fit v's 128)
    mla = cfgs.sm90_forward(192, True)
    assert mla.smem(192, 128) == ((128 + 2 * 128) * 192 + 2 * 128 * 128) * 2 + 1024
    assert mla.instance("bfloat16", 192, True, dv=128).name.startswith(
        "attention_fwd_sm90<cuk::bf16, 192, 128, 128, 2, ")
    attn.Sm90FwdConfig(64, 2, producer=True, overlap=True, persistent=True, warpgroups=3).instance(
        "bfloat16", 192, False, dv=128)
    persistent = attn.Sm90FwdConfig(128, 3, producer=True, overlap=True, persistent=True)
    assert ", true, 1, 230400, false, false>" in persistent.instance("bfloat16", 128, False).name
    causal_name = dataclasses.replace(persistent, pingpong=True).instance("bfloat16", 128, True).name
    assert ", 2, 1, false, true, true, true, true, 1, 230400, false, false>" in causal_name
    capped = dataclasses.replace(persistent, pingpong=True).instance("bfloat16", 128, True, softcap=True)
    assert ", 2, 1, true, true, true, true, true, 1, 230400, false, false>" in capped.name
    for cfg, causal in ((dataclasses.replace(persistent, producer=False), True),
                        (dataclasses.replace(persistent, overlap=False), False)):
        with pytest.raises(ValueError, match="persistent takes a producer and the overlap"):
            cfg.instance("bfloat16", 128, causal)
    # (key tiles shorter than the block's rows: O gets a buffer of its own, 64 more rows of Q's size)
    three = dataclasses.replace(persistent, warpgroups=3)
    assert three.own_o_buffer and not persistent.own_o_buffer
    assert three.smem(64) == (2 * 192 + 2 * 3 * 128) * 64 * 2 + 1024
    with pytest.raises(ValueError, match="takes 263168 bytes of shared memory at head dim 256 .* may have 232448"):
        attn.Sm90FwdConfig(64, 2, producer=True, overlap=True, persistent=True).instance("bfloat16", 256, False)
    # (two blocks an SM: the d64 forward, 128-key tiles and no producer, so that each thread has
    # 128 registers; with a producer, 64-key tiles at most)
    two = cfgs.sm90_forward(64, True)
    assert two.blocks_per_sm == 2 and not two.producer and two.bn == 128 and two.threads == 256
    assert "<cuk::bf16, 64, 64, 128, 2, 2, 1, false, false, true, false, false, 2, 82944, false, false>" in \
        two.instance("bfloat16", 64, True).name
    assert ", true, true, false, false, 2, 66560, false, false>" in \
        dataclasses.replace(two, bn=64, stages=3, producer=True).instance("bfloat16", 64, True).name
    with pytest.raises(ValueError, match="blocks_per_sm=2 with a producer takes key tiles of at most 64 keys, "
                                         "not bn=128"):
        dataclasses.replace(two, producer=True).instance("bfloat16", 64, True)
    for cfg in (dataclasses.replace(two, warpgroups=3), dataclasses.replace(two, blocks_per_sm=3),
                dataclasses.replace(two, producer=True, overlap=True, persistent=True)):
        with pytest.raises(ValueError, match=f"blocks_per_sm={cfg.blocks_per_sm}: 1, or 2 with two warpgroups"):
            cfg.instance("bfloat16", 64, True)
    with pytest.raises(ValueError, match="2 blocks of it do not fit an SM's 233472"):
        dataclasses.replace(two, stages=3).instance("bfloat16", 64, True)
    # (the softcap at d64: 64-key tiles with a producer, every mask, compiled by the check)
    capped = cfgs.sm90_forward(64, True, softcap=True)
    assert capped == cfgs.sm90_forward(64, False, True) == cfgs.get("fwd_sm90_softcap", 64) != two
    assert capped.bn == 64 and capped.producer and capped.blocks_per_sm == 2
    names = {i.name for i in attn.instances()}
    assert all(capped.instance(dt, 64, m, True).name in names for dt in ("bfloat16", "float16") for m in (0, 1, 2))
    assert two.instance("bfloat16", 64, 1, True).name not in names
    assert cfgs.sm90_forward(128, True, True) == cfgs.get("fwd_sm90", 128)


def test_the_sm80_path_can_be_forced_by_the_environment():
    """CUKERN_ATTENTION_SM80=1 turns both Hopper paths off at import (so that the whole suite can
    run the sm_80 kernels on an H100); unset or 0 leaves them on."""
    import subprocess
    import sys

    code = "import importlib; c = importlib.import_module('cukern.attention').configs.CONFIGS; " \
           "print(c.use_sm90, c.use_sm90_bwd)"
    runs = []   # (the three processes at once: each is mostly an interpreter starting and importing)
    for value, expect in (("1", "False False"), ("0", "True True"), (None, "True True")):
        env = {k: v for k, v in os.environ.items() if k != "CUKERN_ATTENTION_SM80"}
        if value is not None:
            env["CUKERN_ATTENTION_SM80"] = value
        runs.append((value, expect, subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                                                     stderr=subprocess.PIPE, text=True)))
    for value, expect, p in runs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, (value, stdout, stderr)
        assert stdout.split() == expect.split(), (value, stdout, stderr)


def test_the_sm90_backward_takes_tensor_maps_of_the_inputs(host_arrays_as_device, monkeypatch):
    """On sm_90 the backward's dK/dV kernel is attention_bwd_sm90 for head dims 64 and 128, with
    tensor maps of q, k, v and dout (boxes of 64 query rows, 128 keys, 64 columns) and dQ by
    the same conversion (or, deterministic, the same pass) as the sm_80 path; other devices,
    head dims and broadcast K/V keep attention_bwd_dkdv."""
    import importlib

    from cukern import _kernels

    attn = importlib.import_module("cukern.attention")
    # (env or not)
    monkeypatch.setattr(attn.configs, "CONFIGS", dataclasses.replace(attn.configs.CONFIGS, use_sm90_bwd=True))

    def launches(d, cc, deterministic=False, kv_heads=2, **kw):
        monkeypatch.setattr(_kernels, "compute_capability", lambda device: cc)
        attn._BWD.clear()   # (plans assume one device: the capability is not in their key)
        q = np.ones((2, 200, 4, d), np.float16)
        kv = np.ones((2, 300, kv_heads, d), np.float16)
        if kv_heads == 1:
            kv = np.broadcast_to(kv, (2, 300, 4, d))
        lse = np.zeros((2, 4, 200), np.float32)
        with pytest.raises(DryRun) as info:
            cukern.attention_backward(q, q, kv, kv, q, lse, causal=True, deterministic=deterministic, **kw)
        launches.plan = info.value.plan
        return [s for s in info.value.plan.steps if isinstance(s, tuple) and s[0] == "launch"]

    steps = launches(128, (9, 0))
    assert [s[1].name.split("<")[0] for s in steps] == ["attention_bwd_dot", "attention_bwd_sm90",
                                                        "attention_bwd_dq_convert"]
    _, inst, grid, _, _, slots = steps[1]
    cfg = attn.configs.CONFIGS.get("bwd_sm90", 128)
    assert inst.name.startswith(f"attention_bwd_sm90<cuk::half, 128, 64, {cfg.stages}, 1, false, true, ")
    # (causal: (batch, kv head) groups a section, key blocks, sections; 32 MB holds all four groups)
    assert inst.arch == "sm_90a" and inst.threads == cfg.threads(False) and grid == (4, 3, 1)
    maps = [(m.index, m.box) for _, m, _ in slots if isinstance(m, _kernels.MapSlot)]
    assert maps[:4] == [(1, (1, 64, 1, 64)), (2, (1, 128, 1, 64)), (3, (1, 128, 1, 64)), (0, (1, 64, 1, 64))]
    # dQ's float32 partial sums (B, Sq, H, D), added to by TMA in boxes of 16 rows x 32 floats
    (acc, box), = maps[4:]
    assert box == (1, 16, 1, 32)
    alloc = launches.plan.allocs[acc - 6]   # (after the six inputs)
    assert (alloc.shape, alloc.dtype) == ((2, 200, 4, 128), "float32")
    # deterministic: dQ's adds in turns (the ordered instance, a turn counter a query tile of
    # `rows`, zeroed before the launch), the same conversion after it
    steps = launches(64, (9, 0), deterministic=True)
    assert [s[1].name.split("<")[0] for s in steps] == ["attention_bwd_dot", "attention_bwd_sm90",
                                                        "attention_bwd_dq_convert"]
    cfg = attn.configs.CONFIGS.get("bwd_sm90", 64)
    assert steps[1][1].name.startswith(f"attention_bwd_sm90<cuk::half, 64, {cfg.block_rows}, {cfg.stages}, 1, false, "
                                       "true, true, ") and steps[1][1].name.endswith(", true, false>")
    assert steps[1][1].threads == cfg.threads(True, True)
    turns = [launches.plan.allocs[i - 6] for i in range(6, 6 + len(launches.plan.allocs))
             if launches.plan.allocs[i - 6].dtype == "int32"]
    assert [t.shape for t in turns] == [(2, 4, -(-200 // cfg.block_rows))]
    # ... but not where both warpgroups add into the same dQ elements (d64's 64-row tiles, the
    # softcap's): dQ's own pass, no producer warpgroup
    steps = launches(64, (9, 0), deterministic=True, softcap=30.0)
    assert [s[1].name.split("<")[0] for s in steps] == ["attention_bwd_dot", "attention_bwd_sm90", "attention_bwd_dq"]
    assert steps[1][1].name.startswith("attention_bwd_sm90<cuk::half, 64, 64, 2, 1, true, false, false, ")
    assert steps[1][1].name.endswith(", false, false>") and steps[1][1].threads == 256
    assert launches(128, (8, 0))[1][1].name.startswith("attention_bwd_dkdv<")          # A100
    assert launches(256, (9, 0))[1][1].name.startswith("attention_bwd_sm90_d256<")     # a kernel of its own
    assert launches(256, (9, 0), deterministic=True)[1][1].name.startswith("attention_bwd_sm90_d256<cuk::half, 1, "
                                                                           "false, true, ")   # (dQ in turns)
    assert launches(128, (9, 0), kv_heads=1)[1][1].name.startswith("attention_bwd_dkdv<")   # stride-0 heads
    monkeypatch.setattr(attn.configs, "CONFIGS", dataclasses.replace(attn.configs.CONFIGS, use_sm90_bwd=False))
    assert launches(128, (9, 0))[1][1].name.startswith("attention_bwd_dkdv<")          # switched off
    attn._BWD.clear()


# ---- the kernel against the reference (GPU) ---------------------------------------------------

@st.composite
def attn_cases(draw, forward=True):
    h, hkv = draw(st.sampled_from([(1, 1), (2, 2), (4, 2), (4, 1), (8, 2), (8, 1), (3, 3)]))
    return dict(
        b=draw(st.sampled_from([1, 2])),
        sq=draw(st.sampled_from([1, 2, 17, 64, 65, 129, 200])),
        sk=draw(st.sampled_from([1, 3, 17, 64, 100, 129, 257])),
        h=h, hkv=hkv,
        d=draw(st.sampled_from([32, 64, 64, 96, 128, 128, 256])),
        dtype=draw(st.sampled_from(ATTN_DTYPES)),
        causal=draw(st.booleans()),
        scale=draw(st.sampled_from([None, None, 0.05, 0.3])),
        framework=draw(st.sampled_from(FRAMEWORKS)),
        deterministic=draw(st.booleans()),   # (the backward's two dQ paths)
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _run_case(c, layout="contiguous"):
    rng = np.random.default_rng(c["seed"])
    dt = c["dtype"]
    q = random_host(rng, (c["b"], c["sq"], c["h"], c["d"]), dt)
    k = random_host(rng, (c["b"], c["sk"], c["hkv"], c["d"]), dt)
    v = random_host(rng, (c["b"], c["sk"], c["hkv"], c["d"]), dt)
    fw = c["framework"]
    poison_allocator(fw, [q.nbytes, c["b"] * c["h"] * c["sq"] * 4])
    if layout == "packed" and c["h"] == c["hkv"] and c["sq"] == c["sk"]:  # views of one (B, S, 3, H, D)
        qkv = to_device(np.stack([q, k, v], axis=2), fw)
        qd, kd, vd = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    else:
        qd, kd, vd = (to_device(a, fw) for a in (q, k, v))
    out, lse = cukern.attention(qd, kd, vd, causal=c["causal"], softmax_scale=c["scale"], return_lse=True)
    e_out, e_lse = ref.attention(q, k, v, causal=c["causal"], softmax_scale=c["scale"], return_lse=True)
    assert type(out) is type(qd) and tuple(out.shape) == q.shape and tuple(lse.shape) == e_lse.shape
    assert_close(out, e_out, dt, "out", tol=TOL[dt])
    got = to_host(lse)
    seen = np.isfinite(e_lse)
    assert np.array_equal(np.isinf(got) & (got > 0), ~seen), "lse must be +inf exactly where no key is seen"
    assert_close(got[seen], e_lse[seen], "float32", "lse", tol=1e-4)


@gpu
@settings(max_examples=120)
@given(c=attn_cases())
def test_attention_matches_reference(c):
    _run_case(c)


@gpu
@settings(max_examples=80)
@given(c=attn_cases(), layout=st.sampled_from(["contiguous", "packed"]), producer=st.booleans(),
       pingpong=st.booleans(), overlap=st.booleans(), warpgroups=st.sampled_from([2, 3]), persistent=st.booleans(),
       two_blocks=st.booleans(), section_pairs=st.sampled_from([None, 1, 3]), blocks=st.sampled_from([0, 2]))
def test_the_sm90_forward_matches_reference(c, layout, producer, pingpong, overlap, warpgroups, persistent,
                                            two_blocks, section_pairs, blocks):
    """The Hopper path (TMA + wgmma, attention_fwd_sm90) on its head dims, forced on, with every
    scheduling option: a producer warpgroup, the warpgroups' turns (pingpong, two warpgroups
    only), the intra-warpgroup overlap, two or three warpgroups of rows, one block an SM
    walking the work tiles (persistent: with a producer and the overlap; one an SM, or two
    blocks in all so that each walks many), two blocks an SM
    (two warpgroups; with a producer or without), and causal tiles in L2 sections of 1 or 3 (batch,
    head) pairs as well as the default's."""
    import importlib

    from cukern import _kernels

    if _kernels.compute_capability(0) != (9, 0):
        pytest.skip("the Hopper path needs an sm_90 GPU")
    attn = importlib.import_module("cukern.attention")
    if c["d"] not in dict(attn.configs.CONFIGS.fwd_sm90):
        c["d"] = 128
    warpgroups = warpgroups if c["d"] <= 128 else 2   # (three: head dims up to 128)
    shipped = attn.configs.CONFIGS.get("fwd_sm90", c["d"])
    cfg = dataclasses.replace(shipped, producer=producer, blocks_per_sm=1, stages=max(shipped.stages, 3),
                              pingpong=pingpong and warpgroups == 2, overlap=overlap, warpgroups=warpgroups)
    while cfg.smem(c["d"]) > 225 * 1024 and cfg.stages > 2:   # (the ring that fits, as a config would)
        cfg = dataclasses.replace(cfg, stages=cfg.stages - 1)
    # (persistent with O in a buffer of its own may not fit: d256's 64-key tiles)
    fits = dataclasses.replace(cfg, persistent=True).smem(c["d"]) <= 225 * 1024
    persistent = persistent and producer and overlap and fits
    cfg = dataclasses.replace(cfg, persistent=persistent)
    if two_blocks and c["d"] == 64 and warpgroups == 2 and not persistent:
        # (two blocks an SM: 128-key tiles without a producer, 64-key tiles with one, 104 registers)
        cfg = dataclasses.replace(cfg, blocks_per_sm=2, bn=64 if producer else 128, stages=3 if producer else 2)
    hopper = dataclasses.replace(attn.configs.CONFIGS.replace("fwd_sm90", c["d"], cfg), fwd_sm90_full=(),
                                 fwd_sm90_softcap=(),
                                 use_sm90=True,
                                 fwd_sm90_blocks=blocks)
    if section_pairs is not None:
        hopper = dataclasses.replace(hopper, l2_section_bytes=section_pairs * c["sk"] * c["d"] * 4)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attn.configs, "CONFIGS", hopper)
        _run_case(c, layout)


@gpu
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_misaligned_contiguous_inputs(framework):
    """q as a contiguous view 2 bytes past an aligned address: read through a copy."""
    rng = np.random.default_rng(12)
    q = random_host(rng, (2, 40, 4, 64), "float16")
    k, v = (random_host(rng, (2, 40, 2, 64), "float16") for _ in range(2))
    buf = to_device(np.concatenate([q.ravel()[:1], q.ravel()]), framework)
    qd = buf[1:].reshape(q.shape)
    out, lse = cukern.attention(qd, to_device(k, framework), to_device(v, framework), return_lse=True)
    assert_close(out, ref.attention(q, k, v), "float16", "out", tol=TOL["float16"])


@gpu
@pytest.mark.parametrize("dtype", ATTN_DTYPES)
@pytest.mark.parametrize("causal", [False, True])
def test_packed_qkv_views_are_read_in_place(dtype, causal):
    _run_case(dict(b=2, sq=100, sk=100, h=4, hkv=4, d=64, dtype=dtype, causal=causal, scale=None,
                   framework="cupy", seed=5), layout="packed")


@gpu
@needs_torch
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("b, sq, sk, h, hkv", [(3, 1000, 777, 32, 8), (1, 300, 129, 2, 1), (2, 128, 1, 4, 4),
                                               (2, 700, 2000, 8, 8), (40, 256, 256, 4, 2)])
def test_the_persistent_forward_walks_every_work_tile(b, sq, sk, h, hkv, causal, d):
    """The persistent Hopper forward (one block an SM over the work tiles, causal ones from an
    atomic counter; O stored by TMA, from the last K buffer at d128 and from a buffer of its own
    with three warpgroups of rows at d64): more work tiles than SMs and fewer, a partial last
    row tile, GQA, a single key, causal rows that see no key (sq > sk), several calls in a row
    (the counter starts at zero each), causal tiles in L2 sections of several sizes, and q laid
    out (B, H, S, D) so that out is too. Bitwise the one-block-a-tile kernel's output, and
    float32 SDPA's within the bf16 tolerance."""
    import importlib

    from cukern import _kernels

    if _kernels.compute_capability(0) != (9, 0):
        pytest.skip("the Hopper path needs an sm_90 GPU")
    attn = importlib.import_module("cukern.attention")
    if d == 128:
        cfg = attn.configs.CONFIGS.sm90_forward(128, causal)
        assert cfg.persistent
    else:
        cfg = attn.Sm90FwdConfig(128, 3, producer=True, overlap=True, warpgroups=3, persistent=True)
        assert cfg.own_o_buffer

    def forced(c):
        return dataclasses.replace(attn.configs.CONFIGS.replace("fwd_sm90", d, c), fwd_sm90_full=(),
                                   fwd_sm90_softcap=(), use_sm90=True)

    def sections(configs, pairs):   # (causal tiles in L2 sections of `pairs` (batch, head) pairs)
        return dataclasses.replace(configs, l2_section_bytes=pairs * sk * d * 4)

    hopper, one_a_tile = forced(cfg), forced(dataclasses.replace(cfg, persistent=False))
    g = torch.Generator(device="cuda").manual_seed(sq + sk + h + d)
    q = torch.randn(b, h, sq, d, device="cuda", dtype=torch.bfloat16, generator=g).transpose(1, 2)
    k, v = (torch.randn(b, sk, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    out1, lse1 = attn._attention(q, k, v, causal, None, True, one_a_tile)
    # (the same plan three times: the counter restarts; then sections of 3 pairs, where the last
    # is partial unless b h is a multiple of 3, and of 1, persistent and one block a tile)
    for configs in (hopper, hopper, hopper, sections(hopper, 3), sections(hopper, 1), sections(one_a_tile, 3)):
        out, lse = attn._attention(q, k, v, causal, None, True, configs)
        assert out.stride() == q.stride(), "out is laid out like q"
        assert torch.equal(out, out1) and torch.equal(lse, lse1)
    qt, kt, vt = (a.float().transpose(1, 2) for a in (q, k, v))
    kt, vt = kt.repeat_interleave(h // hkv, 1), vt.repeat_interleave(h // hkv, 1)
    s = (qt @ kt.transpose(-1, -2)) / d ** 0.5
    if causal:   # (bottom-right: query i sees keys j <= i + sk - sq; a row that sees none is 0, lse +inf)
        seen = torch.arange(sk, device="cuda")[None, :] <= torch.arange(sq, device="cuda")[:, None] + sk - sq
        s = s.masked_fill(~seen, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    lse_ref = torch.logsumexp(s, -1)
    seen_any = torch.isfinite(lse_ref)
    assert torch.equal(lse[~seen_any], torch.full_like(lse[~seen_any], float("inf")))
    # (scale: causal rows that see a few keys are a few values of v, at |v|'s scale, with P rounded
    # to bf16; among 12M elements one such was 1.3 bounds off against the rms alone)
    assert_close(out, to_host((p @ vt).transpose(1, 2)), "bfloat16", "out", tol=TOL["bfloat16"], scale=0.25)
    assert_close(lse[seen_any], to_host(lse_ref[seen_any]), "float32", "lse", tol=1e-4)


@gpu
@needs_torch
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("sq, sk", [(1000, 1000), (2049, 2049), (1000, 2049), (2049, 1000), (8200, 8200),
                                    (300, 8192)])
def test_long_sequences_against_torch_sdpa_float32(sq, sk, causal, d):
    """Through the public API, against float32 SDPA: lengths past the block sizes, and from 8192
    keys on, where the causal d64 forward on Hopper takes the unmasked config (its three
    warpgroups of rows)."""
    g = torch.Generator(device="cuda").manual_seed(sq + sk + d)
    q = torch.randn(1, sq, 4, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(1, sk, 2, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(1, sk, 2, d, device="cuda", dtype=torch.bfloat16, generator=g)
    out, lse = cukern.attention(q, k, v, causal=causal, return_lse=True)
    qt, kt, vt = (a.float().transpose(1, 2) for a in (q, k, v))
    kt, vt = kt.repeat_interleave(2, 1), vt.repeat_interleave(2, 1)
    keys, queries = torch.arange(sk, device="cuda"), torch.arange(sq, device="cuda")
    mask = (keys[None, :] <= queries[:, None] + (sk - sq)) if causal else None
    s = (qt @ kt.transpose(-1, -2)) / d ** 0.5
    if mask is not None:
        s = s.masked_fill(~mask, -float("inf"))
    ref_out = (torch.softmax(s, -1) @ vt).transpose(1, 2)
    ref_lse = torch.logsumexp(s, -1)
    seen = torch.isfinite(ref_lse)
    ref_out = torch.where(seen.transpose(1, 2)[..., None], ref_out, torch.zeros_like(ref_out))
    # (causal: rows that see a few keys are a few values of v, at |v|'s scale, with P rounded to
    # bf16, while the long rows' averages make rms(out) small: errors measured against |v|'s scale)
    assert_close(out, to_host(ref_out), "bfloat16", "out", tol=TOL["bfloat16"], scale=0.25 if causal else 0.0)
    assert_close(to_host(lse[seen]), to_host(ref_lse[seen]), "float32", "lse", tol=1e-4)


@gpu
@needs_torch
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_scores_that_grow_along_the_keys(causal, d):
    """Keys scaled up along the sequence (x0.1 to x6), so that a row's running max grows tile
    after tile and the output is rescaled again and again (peaked rows, a few keys dominating):
    the same results as float32 softmax."""
    g = torch.Generator(device="cuda").manual_seed(d + causal)
    sq = sk = 1500
    q = torch.randn(2, sq, 4, d, device="cuda", generator=g)
    growth = torch.linspace(0.1, 6, sk, device="cuda")[None, :, None, None]
    k = torch.randn(2, sk, 2, d, device="cuda", generator=g) * growth
    v = torch.randn(2, sk, 2, d, device="cuda", generator=g)
    q, k, v = (a.bfloat16() for a in (q, k, v))
    out, lse = cukern.attention(q, k, v, causal=causal, return_lse=True)
    qt = q.float().transpose(1, 2)
    kt, vt = (a.float().transpose(1, 2).repeat_interleave(2, 1) for a in (k, v))   # (GQA: 2 heads a kv head)
    s = (qt @ kt.transpose(-1, -2)) / d ** 0.5
    if causal:
        s = s.masked_fill(torch.ones(sq, sk, device="cuda", dtype=torch.bool).triu(1), -float("inf"))
    assert_close(out, to_host((torch.softmax(s, -1) @ vt).transpose(1, 2)), "bfloat16", "out", tol=TOL["bfloat16"])
    assert_close(lse, to_host(torch.logsumexp(s, -1)), "float32", "lse", tol=1e-4)


# ---- backward ---------------------------------------------------------------------------------

@needs_torch
@pytest.mark.parametrize("causal", [False, True])
def test_reference_backward_matches_torch_autograd(causal):
    rng = np.random.default_rng(7)
    q, k, v = rng.standard_normal((2, 5, 4, 8)), rng.standard_normal((2, 7, 2, 8)), rng.standard_normal((2, 7, 2, 8))
    do = rng.standard_normal(q.shape)
    qt, kt, vt = (torch.tensor(a, requires_grad=True) for a in (q, k, v))
    kk, vv = (a.transpose(1, 2).repeat_interleave(2, 1) for a in (kt, vt))
    mask = torch.tensor(np.arange(7)[None, :] <= np.arange(5)[:, None] + 2) if causal else None
    o = torch.nn.functional.scaled_dot_product_attention(qt.transpose(1, 2), kk, vv, attn_mask=mask, scale=0.3)
    o.transpose(1, 2).backward(torch.tensor(do))
    for got, t in zip(ref.attention_backward(do, q, k, v, causal=causal, softmax_scale=0.3), (qt, kt, vt)):
        np.testing.assert_allclose(got, t.grad.numpy(), rtol=1e-10, atol=1e-12)


def _run_backward_case(c):
    rng = np.random.default_rng(c["seed"])
    dt, fw = c["dtype"], c["framework"]
    q = random_host(rng, (c["b"], c["sq"], c["h"], c["d"]), dt)
    k = random_host(rng, (c["b"], c["sk"], c["hkv"], c["d"]), dt)
    v = random_host(rng, (c["b"], c["sk"], c["hkv"], c["d"]), dt)
    do = random_host(rng, q.shape, dt)
    qd, kd, vd, dod = (to_device(a, fw) for a in (q, k, v, do))
    out, lse = cukern.attention(qd, kd, vd, causal=c["causal"], softmax_scale=c["scale"], return_lse=True)
    poison_allocator(fw, [q.nbytes, k.nbytes, k.nbytes])
    grads = cukern.attention_backward(dod, qd, kd, vd, out, lse, causal=c["causal"], softmax_scale=c["scale"],
                                      deterministic=c["deterministic"])
    expect = ref.attention_backward(do, q, k, v, causal=c["causal"], softmax_scale=c["scale"])
    scales = gradient_scales(do, q, k, v, c["causal"], c["scale"])
    for name, got, e, shape, sc in zip(("dq", "dk", "dv"), grads, expect, (q.shape, k.shape, v.shape), scales):
        assert type(got) is type(qd) and tuple(got.shape) == shape
        assert_close(got, e, dt, name, tol=2 * TOL[dt], scale=sc)


@gpu
@settings(max_examples=80)
@given(c=attn_cases(forward=False))
def test_attention_backward_matches_reference(c):
    _run_backward_case(c)


@gpu
@settings(max_examples=60)
@given(c=attn_cases(forward=False))
def test_the_sm80_backward_matches_reference_everywhere(c):
    """attention_bwd_dkdv forced on: on sm_90 the Hopper backward takes head dims 64 and 128 by
    default, and the sm_80 kernel stays the path of other GPUs."""
    import importlib

    attn = importlib.import_module("cukern.attention")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attn.configs, "CONFIGS", dataclasses.replace(attn.configs.CONFIGS, use_sm90_bwd=False))
        _run_backward_case(c)


@gpu
@settings(max_examples=100)
@given(c=attn_cases(forward=False), sk=st.sampled_from([127, 128, 129, 300, 513]), rows=st.sampled_from([64, 128]),
       producer=st.booleans(), sections=st.sampled_from([None, 1, 4]), persistent=st.booleans())
def test_the_sm90_backward_matches_reference(c, sk, rows, producer, sections, persistent):
    """The Hopper backward (attention_bwd_sm90) on its head dims and query tiles (64 rows, and
    128 at head dim 64), with and without a producer warpgroup, over several key blocks of 128
    (partial last blocks, causal blocks that see few queries, GQA's loop over heads); causal
    blocks numbered in L2 sections of 1 or 4 (batch, kv head) groups (several sections, a
    partial last one) or the default's; without a mask also persistent (with a producer: two
    blocks walk the units)."""
    import importlib

    from cukern import _kernels

    if _kernels.compute_capability(0) != (9, 0):
        pytest.skip("the Hopper path needs an sm_90 GPU")
    attn = importlib.import_module("cukern.attention")
    c["d"] = c["d"] if c["d"] in (64, 128) else 128
    c["sk"] = sk
    cfg = attn.Sm90BwdConfig(rows if c["d"] == 64 else 64, producer=producer, persistent=persistent)
    configs = dataclasses.replace(attn.configs.CONFIGS, bwd_sm90=((c["d"], cfg),), use_sm90_bwd=True, bwd_sm90_blocks=2)
    if sections is not None:
        group_bytes = c["h"] // c["hkv"] * c["sq"] * c["d"] * 8
        configs = dataclasses.replace(configs, bwd_l2_section_bytes=sections * group_bytes)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attn.configs, "CONFIGS", configs)
        _run_backward_case(c)


@gpu
@pytest.mark.parametrize("d", [64, 128])
def test_attention_backward_is_bitwise_deterministic(d):
    import cupy

    rng = np.random.default_rng(d)
    q, do = (cupy.asarray(random_host(rng, (2, 300, 8, d), "bfloat16")) for _ in range(2))
    k, v = (cupy.asarray(random_host(rng, (2, 300, 2, d), "bfloat16")) for _ in range(2))
    out, lse = cukern.attention(q, k, v, causal=True, return_lse=True)
    runs = [[cupy.asnumpy(g).tobytes() for g in cukern.attention_backward(do, q, k, v, out, lse, causal=True,
                                                                          deterministic=True)] for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]
    # deterministic=False changes only how dQ is summed: dk and dv keep their bits.
    fast = [cupy.asnumpy(g) for g in cukern.attention_backward(do, q, k, v, out, lse, causal=True)]
    assert [fast[1].tobytes(), fast[2].tobytes()] == runs[0][1:]
    dq = np.frombuffer(runs[0][0], fast[0].dtype).reshape(fast[0].shape).astype(np.float32)
    np.testing.assert_allclose(fast[0].astype(np.float32), dq, rtol=2e-2, atol=2e-2 * float(np.abs(dq).max()))


@gpu
@pytest.mark.parametrize("shape", [(3, 1000, 1000, 8, 2), (2, 300, 1100, 4, 4), (2, 700, 100, 4, 2),
                                   (1, 2048, 2048, 16, 16)])
@pytest.mark.parametrize("blocks", [1, 3, 0])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_the_persistent_sm90_forward_walks_every_tile(shape, blocks, dtype):
    """The persistent Hopper forward without a mask (d128): one block, a few, or one an SM walk
    every work tile, the ring's phases, Q's reloads and O's staging buffers running on across
    tiles (key tiles past the end, one key tile a work tile, rows past sq). out and lse have the
    bits of one block a work tile (the same sums in the same order) and match the reference."""
    import importlib

    import cupy

    from cukern import _kernels

    if _kernels.compute_capability(0) != (9, 0):
        pytest.skip("the Hopper path needs an sm_90 GPU")
    attn = importlib.import_module("cukern.attention")
    b, sq, sk, h, hkv = shape
    rng = np.random.default_rng(sq + sk + blocks)
    q = random_host(rng, (b, sq, h, 128), dtype)
    k, v = (random_host(rng, (b, sk, hkv, 128), dtype) for _ in range(2))
    cfg = attn.configs.CONFIGS.sm90_forward(128, False)
    assert cfg.persistent and not cfg.pingpong
    walk = dataclasses.replace(attn.configs.CONFIGS, use_sm90=True, fwd_sm90_blocks=blocks)
    one_a_tile = dataclasses.replace(cfg, persistent=False)
    base = dataclasses.replace(attn.configs.CONFIGS.replace("fwd_sm90_full", 128, one_a_tile), use_sm90=True)
    qd, kd, vd = (cupy.asarray(a) for a in (q, k, v))
    poison_allocator("cupy", [q.nbytes, b * h * sq * 4])
    (out, lse), (out_ref, lse_ref) = ([cupy.asnumpy(a) for a in attn._attention(qd, kd, vd, False, None, True, c)]
                                      for c in (walk, base))
    assert out.tobytes() == out_ref.tobytes() and lse.tobytes() == lse_ref.tobytes()
    e_out, e_lse = ref.attention(q, k, v, return_lse=True)
    assert_close(out, e_out, dtype, "out", tol=TOL[dtype])
    assert_close(lse, e_lse, "float32", "lse", tol=1e-4)


@gpu
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("shape", [(3, 1000, 1000, 8, 2), (2, 300, 1100, 4, 4), (1, 2048, 2048, 16, 16)])
@pytest.mark.parametrize("blocks", [3, 0])
@pytest.mark.parametrize("softcap", [0.0, 30.0])
def test_the_persistent_sm90_backward_walks_every_unit(d, shape, blocks, softcap):
    """The persistent Hopper backward (no mask): a few blocks (or one an SM) walk every (batch,
    kv head, key block) unit, the ring's and dS^T buffers' phases running on across units. dk
    and dv have the bits of one block a unit (the same sums in the same order); dq (float32
    atomics) agrees to its rounding."""
    import importlib

    import cupy

    from cukern import _kernels

    if _kernels.compute_capability(0) != (9, 0):
        pytest.skip("the Hopper path needs an sm_90 GPU")
    attn = importlib.import_module("cukern.attention")
    b, sq, sk, h, hkv = shape
    rng = np.random.default_rng(d + sq)
    q, do = (cupy.asarray(random_host(rng, (b, sq, h, d), "bfloat16")) for _ in range(2))
    k, v = (cupy.asarray(random_host(rng, (b, sk, hkv, d), "bfloat16")) for _ in range(2))
    out, lse = cukern.attention(q, k, v, return_lse=True, softcap=softcap)
    which = "bwd_sm90_softcap" if softcap else "bwd_sm90"

    def configs(persistent, **more):   # (the shipped configs with persistent set either way)
        return dataclasses.replace(attn.configs.CONFIGS, use_sm90_bwd=True, **more, **{which: tuple(
            (dd, dataclasses.replace(c, persistent=persistent)) for dd, c in getattr(attn.configs.CONFIGS, which))})

    base, walk = configs(False), configs(True, bwd_sm90_blocks=blocks)
    assert walk.get(which, d).persistent_for(0, False, False)
    got, ref = ([cupy.asnumpy(g) for g in attn._attention_backward(do, q, k, v, out, lse, False, None, False, c,
                                                                   softcap=softcap)] for c in (walk, base))
    assert got[1].tobytes() == ref[1].tobytes() and got[2].tobytes() == ref[2].tobytes()
    dq, dq_ref = got[0].astype(np.float32), ref[0].astype(np.float32)
    bad = np.abs(dq - dq_ref) > 2.0 ** -6 * np.abs(dq_ref) + 1e-3 * float(np.abs(dq_ref).max())
    assert not bad.any(), f"{int(bad.sum())} elements of dq off, the first at {np.argwhere(bad)[0]}"


@gpu
@needs_torch
@pytest.mark.parametrize("d", [32, 64, 96, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("deterministic", [False, True])
def test_attention_backward_against_torch_autograd(d, causal, deterministic):
    g = torch.Generator(device="cuda").manual_seed(d + causal)
    q = torch.randn(2, 1000, 8, d, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(2, 1000, 2, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(2, 1000, 2, d, device="cuda", dtype=torch.bfloat16, generator=g)
    do = torch.randn(2, 1000, 8, d, device="cuda", dtype=torch.bfloat16, generator=g)
    out, lse = cukern.attention(q, k, v, causal=causal, return_lse=True)
    dq, dk, dv = cukern.attention_backward(do, q, k, v, out, lse, causal=causal, deterministic=deterministic)
    qt, kt, vt = (a.float().requires_grad_(True) for a in (q, k, v))
    o = torch.nn.functional.scaled_dot_product_attention(
        qt.transpose(1, 2), kt.transpose(1, 2), vt.transpose(1, 2), is_causal=causal, enable_gqa=True)
    o.transpose(1, 2).backward(do.float())
    scales = gradient_scales(*(to_host(a) for a in (do, q, k, v)), causal, None)
    for name, got, t, sc in zip(("dq", "dk", "dv"), (dq, dk, dv), (qt, kt, vt), scales):
        assert_close(got, to_host(t.grad), "bfloat16", name, tol=2 * TOL["bfloat16"], scale=sc)


# ---- bad inputs ------------------------------------------------------------------------------------

def bad_input_cases(xp):
    """(call, exception, message pattern) of bad arguments, forward and backward
    (tests/test_bad_inputs.py runs them)."""
    q = xp.ones((2, 8, 4, 64), np.float16)
    kv = xp.ones((2, 8, 2, 64), np.float16)
    lse = xp.zeros((2, 4, 8), np.float32)
    cases = [
        (lambda: cukern.attention(q.astype(np.float32), kv, kv), ValueError, r"^q: float32 is not supported"),
        (lambda: cukern.attention(q, kv.astype(np.float64), kv), ValueError, "^k: dtype float64"),
        (lambda: cukern.attention(q[0], kv, kv), ValueError, r"^q: expected \(batch, seqlen, heads, head_dim\)"),
        (lambda: cukern.attention(q, kv, kv[:, :4]), ValueError, "^v: shape"),
        (lambda: cukern.attention(q, kv[:1], kv[:1]), ValueError, "^k: batch 1 does not match"),
        (lambda: cukern.attention(q, xp.ones((2, 8, 3, 64), np.float16), xp.ones((2, 8, 3, 64), np.float16)),
         ValueError, "^k: 3 kv heads do not divide q's 4 heads"),
        (lambda: cukern.attention(q, kv[..., :32], kv[..., :32]), ValueError, "^k: head_dim 32 does not match"),
        (lambda: cukern.attention(q[..., :48], kv[..., :48], kv[..., :48]), ValueError,
         "^q: head_dim 48 is not supported"),
        (lambda: cukern.attention(q, kv.astype(ml_bf16()), kv), ValueError, "^k: dtype bfloat16 differs"),
        (lambda: cukern.attention(q, kv, kv, softmax_scale="x"), TypeError, "^softmax_scale"),
        (lambda: cukern.attention(q, kv, kv, softmax_scale=float("inf")), ValueError, "^softmax_scale"),
        (lambda: cukern.attention_backward(q[:, :4], q, kv, kv, q, lse), ValueError, "^dout: shape"),
        (lambda: cukern.attention_backward(q, q, kv, kv, q.astype(ml_bf16()), lse), ValueError, "^out: dtype"),
        (lambda: cukern.attention_backward(q, q, kv, kv, q, lse[:, :2]), ValueError, r"^lse: shape \(2, 2, 8\)"),
        (lambda: cukern.attention_backward(q, q, kv, kv, q, lse.astype(np.float16)), ValueError, "^lse: dtype"),
        (lambda: cukern.attention_backward(*(xp.ones((1, 4, 2, 80), np.float16) for _ in range(5)),
                                           xp.zeros((1, 2, 4), np.float32)),
         ValueError, "^q: head_dim 80 is not supported by the backward"),
    ]
    if xp is not np:   # (on the CPU, host arrays stand in for device ones)
        cases.append((lambda: cukern.attention(q, np.ones((2, 8, 2, 64), np.float16), kv), TypeError, "^k: a host"))
    return cases


def ml_bf16():
    import ml_dtypes

    return ml_dtypes.bfloat16


@gpu
@pytest.mark.parametrize("sq, sk", [(0, 5), (5, 0), (0, 0)])
def test_empty_sequences(sq, sk):
    import cupy

    q = cupy.ones((1, sq, 2, 64), np.float16)
    kv = cupy.ones((1, sk, 2, 64), np.float16)
    out, lse = cukern.attention(q, kv, kv, return_lse=True)
    assert out.shape == (1, sq, 2, 64) and lse.shape == (1, 2, sq)
    assert not cupy.isnan(out).any()
    if sq:
        assert bool((out == 0).all()) and bool(cupy.isinf(lse).all())


@gpu
@needs_torch
@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_every_layout_gives_the_contiguous_results_bit_for_bit(d, deterministic):
    """(B, S, H, D) contiguous, SDPA's (B, H, S, D) read through its transpose, and slices of
    packed qkv: the same inputs give the same bits, forward and backward (dq by atomics too:
    the same summation order, as the layout changes nothing but addresses), read and written
    in place — each output laid out like its input when that input is dense."""
    g = torch.Generator(device="cuda").manual_seed(d)
    b, s, h, hkv = 2, 300, 8, 2
    base = {n: torch.randn(b, s, hh, d, device="cuda", dtype=torch.bfloat16, generator=g)
            for n, hh in (("q", h), ("k", hkv), ("v", hkv), ("do", h))}

    def run(q, k, v, do):
        out, lse = cukern.attention(q, k, v, causal=True, return_lse=True)
        return (out, lse) + cukern.attention_backward(do, q, k, v, out, lse, causal=True,
                                                      deterministic=deterministic)

    expect = run(*(base[n] for n in ("q", "k", "v", "do")))
    sdpa = {n: a.transpose(1, 2).contiguous().transpose(1, 2) for n, a in base.items()}   # (B, H, S, D) storage
    packed = torch.empty(b, s, h + 2 * hkv, d, device="cuda", dtype=torch.bfloat16)
    packed[:, :, :h], packed[:, :, h:h + hkv], packed[:, :, h + hkv:] = base["q"], base["k"], base["v"]
    layouts = {"sdpa": (sdpa["q"], sdpa["k"], sdpa["v"], sdpa["do"]),
               "packed": (packed[:, :, :h], packed[:, :, h:h + hkv], packed[:, :, h + hkv:], sdpa["do"])}
    for name, args in layouts.items():
        got = run(*args)
        for i, (a, e) in enumerate(zip(got, expect)):
            if i == 2 and not deterministic:   # dq summed by float32 atomics: the order varies run to run
                torch.testing.assert_close(a, e, rtol=2e-2, atol=2e-2)
            else:
                assert torch.equal(a, e), f"{name}: output {i} differs from the contiguous layout's"
        out, _, dq, dk, dv = got
        if name == "sdpa":   # dense inputs: outputs in their layout, so transposing back is free
            assert out.transpose(1, 2).is_contiguous() and dq.transpose(1, 2).is_contiguous()
            assert dk.transpose(1, 2).is_contiguous() and dv.transpose(1, 2).is_contiguous()
        else:                # slices of packed qkv are not dense: the outputs are contiguous
            assert out.is_contiguous() and dq.is_contiguous() and dk.is_contiguous()


# ---- the family's rows in the shared PyTorch-path tests (tests/test_torch_integration.py) ----

def _sdpa_bshd(q, k, v, causal, scale):
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=causal,
                                          scale=scale).transpose(1, 2)


def _sink_bshd(q, k, v, sinks, causal, scale):
    """Attention with sinks as GPT-OSS's eager code computes it: the sink a column of the scores
    before the softmax, dropped after; causal aligned to the bottom right."""
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    kt, vt = (a.repeat_interleave(qt.shape[1] // kt.shape[1], dim=1) for a in (kt, vt))
    s = (qt @ kt.transpose(-1, -2)) * scale
    sq, sk = s.shape[-2], s.shape[-1]
    if causal:
        keep = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq)
        s = s.masked_fill(~keep.to(s.device), float("-inf"))
    col = sinks.to(s.dtype).reshape(1, -1, 1, 1).expand(s.shape[0], -1, sq, 1)
    p = torch.softmax(torch.cat([s, col], dim=-1), dim=-1)[..., :-1]
    return (p.to(vt.dtype) @ vt).transpose(1, 2)


def _dropout_bshd(q, k, v, rng, causal, scale, p):
    """Attention with dropout in PyTorch: the weights dropped by the mask the kernels draw from
    ``rng`` (seed, offset), the kept scaled by 1 / (1 - p); causal aligned to the bottom right."""
    b, sq, h, _ = q.shape
    sk = k.shape[1]
    keep_mask = importlib.import_module("cukern.attention.reference").dropout_keep_mask
    keep = torch.as_tensor(keep_mask(p, int(rng[0]) % 2**64, int(rng[1]) % 2**32, b, h, sq, sk),
                           device=q.device)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    kt, vt = (a.repeat_interleave(qt.shape[1] // kt.shape[1], dim=1) for a in (kt, vt))
    s = (qt @ kt.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~(torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq)).to(s.device),
                          float("-inf"))
    w = torch.softmax(s, dim=-1)
    w = torch.where(keep, w / (1 - p), torch.zeros_like(w))
    return (w.to(vt.dtype) @ vt).transpose(1, 2)


def torch_stand_ins() -> dict:
    from torch_helpers import recompute

    # (the wiring calls use no window and no softcap; packed, one document of all the tokens)
    def packed(q, k, v, c, s):
        return _sdpa_bshd(q[None], k[None], v[None], c, s)[0]

    dense = (lambda q, k, v, c, s, wl, wr, cap, det: (_sdpa_bshd(q, k, v, c, s),
                                                     q.new_zeros(q.shape[0], q.shape[2], q.shape[1])),
             lambda do, q, k, v, o, lse, c, s, wl, wr, cap, det: tuple(recompute(
                 lambda q, k, v: _sdpa_bshd(q, k, v, c, s), (q, k, v), do)))
    sink = (lambda q, k, v, sk, c, s, wl, wr, cap, det: (_sink_bshd(q, k, v, sk, c, s),
                                                          q.new_zeros(q.shape[0], q.shape[2], q.shape[1])),
            lambda do, q, k, v, sk, o, lse, c, s, wl, wr, cap, det: tuple(recompute(
                lambda q, k, v, sk: _sink_bshd(q, k, v, sk, c, s), (q, k, v, sk), do)))
    dropping = (lambda q, k, v, rng, c, s, wl, wr, cap, p, det: (_dropout_bshd(q, k, v, rng, c, s, p),
                                                                q.new_zeros(q.shape[0], q.shape[2], q.shape[1])),
                lambda do, q, k, v, rng, o, lse, c, s, wl, wr, cap, p, det: tuple(recompute(
                    lambda q, k, v: _dropout_bshd(q, k, v, rng, c, s, p), (q, k, v), do)))
    packed_dropping = (
        lambda q, k, v, cq, ck, rng, mq, mk, c, s, wl, wr, cap, p, det: (
            _dropout_bshd(q[None], k[None], v[None], rng, c, s, p)[0], q.new_zeros(q.shape[1], q.shape[0])),
        lambda do, q, k, v, o, lse, cq, ck, rng, mq, mk, c, s, wl, wr, cap, p, det: tuple(recompute(
            lambda q, k, v: _dropout_bshd(q[None], k[None], v[None], rng, c, s, p)[0], (q, k, v), do)))
    return {"attention": dense, "attention_lse": dense, "attention_sink": sink, "attention_sink_lse": sink,
            "attention_dropout": dropping, "attention_varlen_dropout": packed_dropping,
            "attention_varlen_sink": (
                lambda q, k, v, cq, ck, sk, mq, mk, c, s, wl, wr, cap, det: (
                    _sink_bshd(q[None], k[None], v[None], sk, c, s)[0], q.new_zeros(q.shape[1], q.shape[0])),
                lambda do, q, k, v, o, lse, cq, ck, sk, mq, mk, c, s, wl, wr, cap, det: tuple(recompute(
                    lambda q, k, v, sk: _sink_bshd(q[None], k[None], v[None], sk, c, s)[0], (q, k, v, sk), do))),
            "attention_varlen": (lambda q, k, v, cq, ck, mq, mk, c, s, wl, wr, cap, det: (
                                     packed(q, k, v, c, s), q.new_zeros(q.shape[1], q.shape[0])),
                                 lambda do, q, k, v, o, lse, cq, ck, mq, mk, c, s, wl, wr, cap, det: tuple(recompute(
                                     lambda q, k, v: packed(q, k, v, c, s), (q, k, v), do)))}


def torch_wiring_calls(which: str, g) -> list:
    q, k, v = (torch.randn(2, 6, 2, 8, generator=g).requires_grad_(which != "w") for _ in range(3))
    qp, kp, vp = (torch.randn(6, 2, 8, generator=g).requires_grad_(which != "w") for _ in range(3))
    cu = torch.tensor([0, 6], dtype=torch.int32)
    sk = (torch.randn(2, generator=g) * 2).requires_grad_(which != "x")
    rng = torch.tensor([-5, 9], dtype=torch.int64)   # (a seed past 2**63, as int64)
    return [("attention", (q, k, v, True, 0.3, -1, -1, 0.0, -1), lambda: _sdpa_bshd(q, k, v, True, 0.3), (q, k, v)),
            ("attention_lse", (q, k, v, True, 0.3, -1, -1, 0.0, -1), lambda: _sdpa_bshd(q, k, v, True, 0.3),
             (q, k, v)),
            ("attention_varlen", (qp, kp, vp, cu, cu, 6, 6, True, 0.3, -1, -1, 0.0, -1),
             lambda: _sdpa_bshd(qp[None], kp[None], vp[None], True, 0.3)[0], (qp, kp, vp)),
            ("attention_sink", (q, k, v, sk, True, 0.3, -1, -1, 0.0, -1), lambda: _sink_bshd(q, k, v, sk, True, 0.3),
             (q, k, v, sk)),
            ("attention_sink_lse", (q, k, v, sk, False, 0.3, -1, -1, 0.0, -1),
             lambda: _sink_bshd(q, k, v, sk, False, 0.3), (q, k, v, sk)),
            ("attention_varlen_sink", (qp, kp, vp, cu, cu, sk, 6, 6, True, 0.3, -1, -1, 0.0, -1),
             lambda: _sink_bshd(qp[None], kp[None], vp[None], sk, True, 0.3)[0], (qp, kp, vp, sk)),
            ("attention_dropout", (q, k, v, rng, True, 0.3, -1, -1, 0.0, 0.25, -1),
             lambda: _dropout_bshd(q, k, v, rng, True, 0.3, 0.25), (q, k, v)),
            # (one document of every token: drawn at the pack's places, as one batch row)
            ("attention_varlen_dropout", (qp, kp, vp, cu, cu, rng, 6, 6, True, 0.3, -1, -1, 0.0, 0.25, -1),
             lambda: _dropout_bshd(qp[None], kp[None], vp[None], rng, True, 0.3, 0.25)[0], (qp, kp, vp))]


def opcheck_samples() -> list:
    from torch_helpers import leaf

    bf = torch.bfloat16
    cu = torch.tensor([0, 17, 17, 40], dtype=torch.int32, device="cuda")
    return [(torch.ops.cukern.attention.default, (leaf((2, 40, 4, 64), bf, 0), leaf((2, 40, 2, 64), bf, 1),
                                                  leaf((2, 40, 2, 64), bf, 2), True, 0.125, 16, -1, 5.0, -1)),
            (torch.ops.cukern.attention_lse.default, (leaf((2, 40, 4, 64), bf, 0), leaf((2, 40, 2, 64), bf, 1),
                                                      leaf((2, 40, 2, 64), bf, 2), False, 0.125, -1, -1, 0.0, 1)),
            (torch.ops.cukern.attention_varlen.default, (leaf((40, 4, 64), bf, 0), leaf((40, 2, 64), bf, 1),
                                                         leaf((40, 2, 64), bf, 2), cu, cu, 23, 23, True, 0.125, -1,
                                                         -1, 0.0, -1)),
            (torch.ops.cukern.attention_sink.default, (leaf((2, 40, 4, 64), bf, 0), leaf((2, 40, 2, 64), bf, 1),
                                                       leaf((2, 40, 2, 64), bf, 2), leaf((4,), torch.float32, 3),
                                                       True, 0.125, 16, -1, 0.0, -1)),
            (torch.ops.cukern.attention_sink_lse.default, (leaf((2, 40, 4, 64), bf, 0), leaf((2, 40, 2, 64), bf, 1),
                                                           leaf((2, 40, 2, 64), bf, 2), leaf((4,), torch.float32, 3),
                                                           False, 0.125, -1, -1, 0.0, 1)),
            (torch.ops.cukern.attention_varlen_sink.default, (leaf((40, 4, 64), bf, 0), leaf((40, 2, 64), bf, 1),
                                                              leaf((40, 2, 64), bf, 2), cu, cu,
                                                              leaf((4,), torch.float32, 3), 23, 23, True, 0.125, -1,
                                                              -1, 0.0, -1)),
            (torch.ops.cukern.attention_dropout.default, (leaf((2, 40, 4, 64), bf, 0), leaf((2, 40, 2, 64), bf, 1),
                                                          leaf((2, 40, 2, 64), bf, 2),
                                                          torch.tensor([7, 3], dtype=torch.int64, device="cuda"),
                                                          True, 0.125, 16, -1, 0.0, 0.1, -1)),
            (torch.ops.cukern.attention_varlen_dropout.default, (
                leaf((40, 4, 64), bf, 0), leaf((40, 2, 64), bf, 1), leaf((40, 2, 64), bf, 2), cu, cu,
                torch.tensor([-7, 3], dtype=torch.int64, device="cuda"), 23, 23, True, 0.125, -1, -1, 0.0, 0.2, 1))]


def torch_kernel_cases() -> dict:
    import cukern.torch as ct
    from torch_helpers import leaf

    q, k, v = (leaf((2, 8, 256, 64), torch.bfloat16, s) for s in range(3))
    do = leaf((2, 8, 256, 64), torch.bfloat16, 3).detach()
    import importlib

    attn = importlib.import_module("cukern.attention")
    hopper = attn.configs.CONFIGS.use_sm90 and torch.cuda.get_device_capability() == (9, 0)
    hopper_bwd = attn.configs.CONFIGS.use_sm90_bwd and torch.cuda.get_device_capability() == (9, 0)
    return {"sdpa": (lambda: torch.autograd.grad(ct.scaled_dot_product_attention(q, k, v, is_causal=True),
                                                 (q, k, v), do),
                     ["attention_bwd_sm90" if hopper_bwd else "attention_bwd_dkdv", "attention_bwd_dot",
                      "attention_bwd_dq_convert",
                      "attention_fwd_sm90" if hopper else "attention_fwd"])}
