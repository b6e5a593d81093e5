"""RoPE: the references and the frequencies (no GPU), argument checking, and the kernels against
the references and against Hugging Face's eager code (GPU)."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import cukern
from cukern import reference as ref

from arrays import (FLOAT_DTYPES, assert_close, poison_allocator, random_host, to_device, to_host,
                    torch)

gpu = pytest.mark.gpu
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")


def _tables(S, D, interleaved, base=10000.0, batch=1, positions=None):
    inv = cukern.rope_inv_freq(D, base)
    pos = np.arange(S, dtype=np.float64) if positions is None else positions
    f = pos[..., None] * inv                                  # (S, D/2) or (B, S, D/2)
    emb = np.repeat(f, 2, axis=-1) if interleaved else np.concatenate([f, f], axis=-1)
    if emb.ndim == 2:
        emb = np.broadcast_to(emb, (batch, S, D))
    return np.cos(emb), np.sin(emb)


# ---- the references, no GPU -------------------------------------------------------------------

@pytest.mark.parametrize("interleaved", [False, True])
def test_reference_is_a_rotation_of_each_pair_by_its_angle(interleaved):
    rng = np.random.default_rng(0)
    B, H, S, D = 2, 3, 7, 16
    q = rng.standard_normal((B, H, S, D))
    cos, sin = _tables(S, D, interleaved)
    out, none = ref.rope(q, None, cos, sin, interleaved=interleaved)
    assert none is None
    lo, hi = (slice(0, None, 2), slice(1, None, 2)) if interleaved else (slice(0, D // 2), slice(D // 2, None))
    angle = np.outer(np.arange(S), cukern.rope_inv_freq(D))
    z = (q[..., lo] + 1j * q[..., hi]) * np.exp(1j * angle)
    np.testing.assert_allclose(out[..., lo], z.real, atol=1e-12)
    np.testing.assert_allclose(out[..., hi], z.imag, atol=1e-12)
    # the backward is the transpose: <rope(q), g> = <q, rope_backward(g)>
    g = rng.standard_normal(q.shape)
    dq, _ = ref.rope_backward(g, None, cos, sin, interleaved=interleaved)
    assert abs((out * g).sum() - (q * dq).sum()) < 1e-9


@needs_torch
def test_llama3_frequencies_are_hugging_faces():
    """rope_inv_freq with LLaMA 3's rope_scaling against Hugging Face's formula as written there."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    base, dim = 500000.0, 128
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float64) / dim))
    low_freq_wavelen = 8192 / 1.0
    high_freq_wavelen = 8192 / 4.0
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / 8.0, inv_freq)
    smooth_factor = (8192 / wavelen - 1.0) / (4.0 - 1.0)
    smoothed_inv_freq = (1 - smooth_factor) * inv_freq_llama / 8.0 + smooth_factor * inv_freq_llama
    is_medium_freq = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    want = torch.where(is_medium_freq, smoothed_inv_freq, inv_freq_llama).numpy()
    np.testing.assert_allclose(cukern.rope_inv_freq(dim, base, scaling), want, rtol=1e-12)
    np.testing.assert_allclose(cukern.rope_inv_freq(dim, base), inv_freq.numpy(), rtol=1e-12)


# ---- argument checking that needs no GPU ------------------------------------------------------

def bad_input_cases(xp):
    """(call, exception, message pattern) of bad arguments (tests/test_bad_inputs.py runs them)."""
    q = xp.ones((2, 4, 6, 8), np.float32)
    k = xp.ones((2, 1, 6, 8), np.float32)
    c = xp.ones((1, 6, 8), np.float32)
    cases = [
        (lambda: cukern.rope(q[0], k, c, c), ValueError, r"^q: expected \(B, H, S, D\)"),
        (lambda: cukern.rope(xp.ones((2, 4, 6, 7), np.float32), None, c[..., :7], c[..., :7]), ValueError,
         "^q: the head dim D = 7 must be even"),
        (lambda: cukern.rope(q, xp.ones((2, 1, 5, 8), np.float32), c, c), ValueError, r"^k: expected \(B, Hk, S, D\)"),
        (lambda: cukern.rope(q, k, xp.ones((3, 6, 8), np.float32), c), ValueError, "^cos: expected"),
        (lambda: cukern.rope(q, k, c, c[0]), ValueError, "^sin: shape"),
        (lambda: cukern.rope(q, k.astype(np.float16), c, c), ValueError, "^k: dtype float16 differs"),
        (lambda: cukern.rope(q, k, c, c, interleaved=1), TypeError, "^interleaved: expected a bool"),
        (lambda: cukern.rope_backward(q, k, c.astype(np.float16), c), ValueError, "^cos: dtype float16"),
        # (float32 tables go with 16-bit q and k only; cos and sin of one dtype)
        (lambda: cukern.rope(q.astype(np.float16), k.astype(np.float16), c, c.astype(np.float16)), ValueError,
         "^sin: dtype float16 differs from cos's float32"),
        (lambda: cukern.rope(q, k, c.astype(np.float16), c.astype(np.float16)), ValueError,
         r"^cos: dtype float16 differs from q's float32 \(float32 tables"),
        (lambda: cukern.rope_inv_freq(7), ValueError, "^dim: expected an even integer"),
        (lambda: cukern.rope_inv_freq(8, scaling={"rope_type": "yarn"}), ValueError, "^scaling: rope_type 'yarn'"),
        (lambda: cukern.rope_inv_freq(8, scaling={"rope_type": "llama3", "factor": 8}), ValueError,
         "^scaling: 'llama3' needs 'low_freq_factor'"),
        (lambda: cukern.rope(np.ones((2, 4, 6, 8), np.float32), k, c, c), TypeError, "^q: a host"),
    ]
    if xp is np:
        cases = [c for c in cases if "host" not in c[2]]
    return cases




# ---- the kernels against the references (GPU) ---------------------------------------------------

def _qk(rng, B, HQ, HK, S, D, dtype, framework, layout):
    """q and k as device arrays: (B, H, S, D) contiguous, the (B, H, S, D) views of (B, S, H, D)
    projections (Hugging Face's), or with a non-unit stride along D (copied by the op)."""
    q, k = random_host(rng, (B, HQ, S, D), dtype), random_host(rng, (B, HK, S, D), dtype)
    if layout == "bshd":
        def dev(a):
            d = to_device(np.ascontiguousarray(a.transpose(0, 2, 1, 3)), framework)
            return d.transpose(1, 2) if framework == "torch" else d.transpose(0, 2, 1, 3)
        return q, k, dev(q), dev(k)
    if layout == "strided_d":
        def dev(a):
            wide = to_device(np.repeat(a, 2, axis=-1), framework)
            return wide[..., ::2]
        return q, k, dev(q), dev(k)
    return q, k, to_device(q, framework), to_device(k, framework)


@st.composite
def rope_cases(draw):
    return dict(B=draw(st.sampled_from([1, 2, 3])), S=draw(st.sampled_from([1, 5, 64, 130])),
                HQ=draw(st.sampled_from([1, 4, 8])), HK=draw(st.sampled_from([0, 1, 2, 8])),
                D=draw(st.sampled_from([2, 8, 16, 64, 96, 128, 256])), dtype=draw(st.sampled_from(FLOAT_DTYPES)),
                interleaved=draw(st.booleans()),
                framework=draw(st.sampled_from(["cupy", "torch"] if torch else ["cupy"])),
                layout=draw(st.sampled_from(["contiguous", "bshd", "bshd", "strided_d"])),
                per_batch=draw(st.booleans()), seed=draw(st.integers(0, 2**31 - 1)),
                float32_tables=draw(st.sampled_from([False, False, True])))


def _run_case(c):
    rng = np.random.default_rng(c["seed"])
    B, S, HQ, HK, D, dtype, fw = c["B"], c["S"], c["HQ"], c["HK"], c["D"], c["dtype"], c["framework"]
    q, k, qd, kd = _qk(rng, B, HQ, HK, S, D, dtype, fw, c["layout"])
    positions = rng.integers(0, 4096, (B, S)).astype(np.float64) if c["per_batch"] else None
    cos, sin = _tables(S, D, c["interleaved"], batch=B if c["per_batch"] else 1, positions=positions)
    from arrays import np_dtype

    # (float32 tables with 16-bit q and k: Hugging Face's models under autocast)
    tables = "float32" if c.get("float32_tables") and dtype in ("float16", "bfloat16") else dtype
    cos, sin = (a.astype(np_dtype(tables)) for a in (cos, sin))
    if HK == 0:
        k, kd = None, None
    poison_allocator(fw, [q.nbytes, q.nbytes])
    oq, ok = cukern.rope(qd, kd, to_device(cos, fw), to_device(sin, fw), interleaved=c["interleaved"])
    eq, ek = ref.rope(q, k, cos, sin, interleaved=c["interleaved"])
    assert tuple(oq.shape) == q.shape
    assert_close(oq, eq, dtype, "q_out")
    if k is None:
        assert ok is None
    else:
        assert_close(ok, ek, dtype, "k_out")
    gq, gk = (None if a is None else random_host(rng, a.shape, dtype) for a in (q, k))
    poison_allocator(fw, [q.nbytes, q.nbytes])
    dq, dk = cukern.rope_backward(to_device(gq, fw), None if gk is None else to_device(gk, fw), to_device(cos, fw),
                                  to_device(sin, fw), interleaved=c["interleaved"])
    rq, rk = ref.rope_backward(gq, gk, cos, sin, interleaved=c["interleaved"])
    assert_close(dq, rq, dtype, "dq")
    if gk is not None:
        assert_close(dk, rk, dtype, "dk")


@gpu
@settings(max_examples=150)
@given(c=rope_cases())
def test_kernels_match_the_reference(c):
    _run_case(c)


def _hf_inputs(seed, tdt, batch, seq, d, base):
    """Leaves q (B, 8, S, D) and k (B, 2, S, D) of dtype tdt, views of (B, S, H, D) tensors (as Hugging
    Face's attention gives them), and the float32 inverse frequencies of head dim d and ``base``."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k = (torch.randn(batch, seq, h, d, device="cuda", generator=g).to(tdt).transpose(1, 2).requires_grad_(True)
            for h in (8, 2))
    return q, k, torch.tensor(cukern.rope_inv_freq(d, base), device="cuda", dtype=torch.float32)


@gpu
@needs_torch
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_against_hugging_faces_code(dtype):
    """cukern.torch.apply_rotary_pos_emb against Hugging Face's apply_rotary_pos_emb in eager, on
    its (B, H, S, D) views, forward and autograd: the outputs equal bit for bit (the same three
    roundings an element; float32's products and sums not contracted into fmas)."""
    import cukern.torch as ct
    from cukern.rope import _hf

    tdt = getattr(torch, dtype)
    B, S = 2, 256
    q, k, inv = _hf_inputs(1, tdt, B, S, 128, 500000.0)
    pos = torch.arange(S, device="cuda", dtype=torch.float32)[None].expand(B, S)
    f = pos[..., None] * inv
    emb = torch.cat((f, f), dim=-1)
    cos, sin = emb.cos().to(tdt), emb.sin().to(tdt)
    got = ct.apply_rotary_pos_emb(q, k, cos, sin)
    want = _hf(q, k, cos, sin)
    dq, dk = (torch.randn_like(t) for t in want)
    gg = torch.autograd.grad(got, (q, k), (dq, dk))
    wg = torch.autograd.grad(want, (q, k), (dq, dk))
    for name, a, e in (("q", got[0], want[0]), ("k", got[1], want[1]), ("dq", gg[0], wg[0]), ("dk", gg[1], wg[1])):
        assert a.shape == e.shape and (name.startswith("d") or a.stride() == e.stride()), name
        assert torch.equal(a, e), f"{name}: {(a != e).float().mean().item():.2e} of the elements differ"
        assert_close(a, to_host(e), dtype, name)
    # (B, S, H, D) tensors with unsqueeze_dim=2
    qs, ks = q.detach().transpose(1, 2), k.detach().transpose(1, 2)
    o2 = ct.apply_rotary_pos_emb(qs, ks, cos, sin, unsqueeze_dim=2)
    assert torch.equal(o2[0].transpose(1, 2), got[0].detach())


def _wide_values(g, shape, tdt):
    """Random signs and mantissas over many binades (bfloat16: 2^-60 .. 2^40; float16: 2^-26 ..
    2^12, into its subnormals), some exact zeros of either sign: products and sums of these round
    where randn's values never would. (bfloat16 products stay normal: below 2^-126 float32 rounds
    a product before PyTorch rounds it to bfloat16, and the two roundings can differ from one.)"""
    lo, hi = (-60, 40) if tdt == torch.bfloat16 else (-26, 12)
    e = torch.randint(lo, hi, shape, device="cuda", generator=g).float()
    m = 1 + torch.rand(shape, device="cuda", generator=g)
    sign = torch.randint(0, 2, shape, device="cuda", generator=g).float() * 2 - 1
    v = sign * m * torch.exp2(e)
    v[torch.rand(shape, device="cuda", generator=g) < 0.02] = 0.0
    v[torch.rand(shape, device="cuda", generator=g) < 0.02] = -0.0
    return v.to(tdt)


@gpu
@needs_torch
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("interleaved", [False, True])
def test_packed_pairs_round_as_pytorch_over_many_binades(dtype, interleaved):
    """16-bit q, k and tables run as pairs of values a word (one fma.rn each product, sum and
    difference): bit for bit PyTorch eager's products and sums in the dtype (float32 arithmetic,
    each result rounded), forward and backward, on values spread over many binades, with signed
    zeros (and float16 subnormals)."""
    tdt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(3)
    B, H, S, D = 2, 3, 64, 64
    q, k, dq, dk = (_wide_values(g, (B, h, S, D), tdt) for h in (H, 2, H, 2))
    cos, sin = (_wide_values(g, (1, S, D), tdt) for _ in range(2))

    def pairs(x):
        return (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., : D // 2], x[..., D // 2:])

    def join(lo, hi):
        return torch.stack((lo, hi), dim=-1).flatten(-2) if interleaved else torch.cat((lo, hi), dim=-1)

    def eager(x, bwd):
        (xl, xh), (cl, ch), (sl, sh) = pairs(x), pairs(cos[:, None]), pairs(sin[:, None])
        if bwd:
            return join(xl * cl + xh * sh, xh * ch - xl * sl)
        return join(xl * cl - xh * sl, xh * ch + xl * sh)

    got = (*cukern.rope(q, k, cos, sin, interleaved=interleaved),
           *cukern.rope_backward(dq, dk, cos, sin, interleaved=interleaved))
    want = (eager(q, False), eager(k, False), eager(dq, True), eager(dk, True))
    for name, a, e in zip(("q_out", "k_out", "dq", "dk"), got, want):
        same = (a.view(torch.int16) == e.view(torch.int16)) | (torch.isnan(a) & torch.isnan(e))
        assert bool(same.all()), f"{name}: {(~same).float().mean().item():.2e} of the elements differ"


@gpu
@needs_torch
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_float32_tables_under_autocast_give_hugging_faces_bits(dtype):
    """Hugging Face's models under autocast: float32 cos and sin with 16-bit q and k. PyTorch
    promotes the products to float32 and autocast rounds the result to the 16-bit dtype before
    attention; the kernel's output is that rounding, bit for bit, and so are the gradients
    (autograd casts each term to q's dtype)."""
    import cukern.torch as ct
    from cukern.rope import _hf

    tdt = getattr(torch, dtype)
    B, S = 2, 200
    q, k, inv = _hf_inputs(2, tdt, B, S, 64, 10000.0)
    f = torch.arange(S, device="cuda", dtype=torch.float32)[None, :, None] * inv
    emb = torch.cat((f, f), dim=-1).expand(B, -1, -1)
    cos, sin = emb.cos(), emb.sin()
    ct.reset_counts()
    with torch.autocast("cuda", dtype=tdt):
        got = ct.apply_rotary_pos_emb(q, k, cos, sin)
        want = tuple(t.to(tdt) for t in _hf(q, k, cos, sin))
    assert ct.counts()["rope"] == {"cukern": 1, "torch": 0}
    dq, dk = (torch.randn_like(t) for t in want)
    gg = torch.autograd.grad(got, (q, k), (dq, dk))
    wg = torch.autograd.grad(want, (q, k), (dq, dk))
    for name, a, e in (("q", got[0], want[0]), ("k", got[1], want[1]), ("dq", gg[0], wg[0]), ("dk", gg[1], wg[1])):
        assert a.dtype == e.dtype == tdt, name
        assert torch.equal(a, e), f"{name}: {(a != e).float().mean().item():.2e} of the elements differ"
    # outside autocast the promoted result would be float32: Hugging Face's code, counted
    ct.reset_counts()
    out = ct.apply_rotary_pos_emb(q, k, cos, sin)
    assert out[0].dtype == torch.float32
    assert ct.counts(reasons=True)["rope"]["torch"] == 1


@gpu
@pytest.mark.parametrize("framework", ["cupy", "torch"])
def test_empty_inputs_give_empty_outputs(framework):
    if framework == "torch" and torch is None:
        pytest.skip("torch is not installed")
    q = to_device(np.ones((2, 4, 0, 8), np.float32), framework)
    c = to_device(np.ones((1, 0, 8), np.float32), framework)
    oq, ok = cukern.rope(q, q, c, c)
    assert tuple(oq.shape) == (2, 4, 0, 8) and tuple(ok.shape) == (2, 4, 0, 8)


# ---- the family's rows in the shared PyTorch-path tests ------------------------------------------

def torch_stand_ins() -> dict:
    """op -> (forward, backward) computed by PyTorch on the CPU (the op's wiring is tested)."""

    def rot(x, cos, sin, transpose):
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        h = x.shape[-1] // 2
        if not transpose:   # x c + rotate_half(x) s
            return x * c + torch.cat((-x[..., h:], x[..., :h]), dim=-1) * s
        g = x * s           # its transpose: x c + (g[hi], -g[lo])
        return x * c + torch.cat((g[..., h:], -g[..., :h]), dim=-1)

    return {"rope": (lambda q, k, cos, sin, il: (rot(q, cos, sin, False), rot(k, cos, sin, False)),
                     lambda dq, dk, cos, sin, il: (rot(dq, cos, sin, True), rot(dk, cos, sin, True)))}


def torch_wiring_calls(which: str, g) -> list:
    """(op, its arguments, PyTorch's same computation, the inputs that may need gradients)."""
    from cukern.rope import _hf

    # (the shared test differentiates the first output: q's; k's gradient is the same code)
    q = torch.randn(2, 4, 5, 8, generator=g).requires_grad_(which in ("x", "both"))
    k = torch.randn(2, 2, 5, 8, generator=g)
    cos, sin = (torch.tensor(a, dtype=torch.float32) for a in _tables(5, 8, False))
    return [("rope", (q, k, cos, sin, False), lambda: _hf(q, k, cos, sin)[0], (q,))]


def opcheck_samples() -> list:
    from torch_helpers import leaf

    ops = torch.ops.cukern
    bf = torch.bfloat16
    cos, sin = (torch.tensor(a, device="cuda").to(bf) for a in _tables(16, 64, False))
    q = leaf((2, 16, 4, 64), bf, 0).transpose(1, 2)
    return [(ops.rope.default, (q, leaf((2, 1, 16, 64), bf, 1), cos, sin, False)),
            (ops.rope.default, (leaf((1, 2, 16, 64), torch.float32, 2), leaf((1, 2, 16, 64), torch.float32, 3),
                                cos.float(), sin.float(), True))]


def torch_native_cases() -> dict:
    """Replays from C++ (tests/test_torch_native.py): Hugging Face's layout and GQA."""
    import cukern.torch as ct
    from torch_helpers import leaf

    def call(q, k):
        S, D = q.shape[2], q.shape[3]
        cos, sin = (torch.tensor(a, device="cuda").to(q.dtype) for a in _tables(S, D, False))
        oq, ok = ct.apply_rotary_pos_emb(q, k, cos, sin)
        return torch.cat((oq.flatten(), ok.flatten()))

    return {"rope_hf_layout": lambda dt: ((leaf((2, 64, 8, 128), dt, 0).transpose(1, 2),
                                           leaf((2, 64, 2, 128), dt, 1).transpose(1, 2)), call)}
