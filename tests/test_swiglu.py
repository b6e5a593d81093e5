"""SwiGLU / GeGLU: the references (no GPU), argument checking, and the kernels against the
references and against PyTorch's eager code (GPU)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import cukern
from cukern import reference as ref

from arrays import (FLOAT_DTYPES, assert_close, poison_allocator, random_host, to_device, to_host,
                    torch)

gpu = pytest.mark.gpu
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")

ACTS = ["silu", "gelu", "gelu_tanh"]
# Widths around the vector width (8 for 2-byte types, 4 for float32) and the threads a row
# (a power of two up to 256 vectors, more beyond); 14336: LLaMA-3 8B's intermediate size.
WIDTHS = [1, 2, 3, 7, 8, 9, 31, 32, 33, 100, 256, 1000, 2048, 2056, 4096, 14336]


def _fwd(act, gate, up, lib=cukern):
    if act == "silu":
        return lib.swiglu(gate, up)
    return lib.geglu(gate, up, "none" if act == "gelu" else "tanh")


def _bwd(act, dy, gate, up, lib=cukern):
    if act == "silu":
        return lib.swiglu_backward(dy, gate, up)
    return lib.geglu_backward(dy, gate, up, "none" if act == "gelu" else "tanh")


def _torch_act(act, x):
    F = torch.nn.functional
    return F.silu(x) if act == "silu" else F.gelu(x, approximate="none" if act == "gelu" else "tanh")


# ---- the references, no GPU -------------------------------------------------------------------

@pytest.mark.parametrize("act", ACTS)
def test_reference_backward_matches_finite_differences(act):
    rng = np.random.default_rng(0)
    g, u, dy = (rng.standard_normal((3, 5)) * 2 for _ in range(3))
    dg, du = _bwd(act, dy, g, u, ref)
    eps = 1e-6
    num_g, num_u = np.zeros_like(g), np.zeros_like(u)
    for idx in np.ndindex(g.shape):
        for arr, out in ((g, num_g), (u, num_u)):
            p, m = arr.copy(), arr.copy()
            p[idx] += eps
            m[idx] -= eps
            args_p = (p, u) if arr is g else (g, p)
            args_m = (m, u) if arr is g else (g, m)
            out[idx] = ((_fwd(act, *args_p, ref) - _fwd(act, *args_m, ref)) * dy).sum() / (2 * eps)
    np.testing.assert_allclose(dg, num_g, rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(du, num_u, rtol=1e-6, atol=1e-8)


@needs_torch
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", ["float64", "bfloat16", "float16"])
def test_reference_is_pytorchs_eager_code(act, dtype):
    """float64: act(gate) * up exactly; 16-bit: the activation rounded to the dtype before the
    product, as PyTorch's two eager ops, forward and autograd (to a rounding of the output)."""
    rng = np.random.default_rng(1)
    g, u, dy = (random_host(rng, (5, 40), "float32", scale=2.0) for _ in range(3))
    tdt = getattr(torch, dtype)
    tg, tu, tdy = (torch.tensor(a).to(tdt) for a in (g, u, dy))
    tg.requires_grad_(True)
    tu.requires_grad_(True)
    y = _torch_act(act, tg) * tu
    dg, du = torch.autograd.grad(y, (tg, tu), tdy)
    host = [t.detach().float().numpy().astype(np.float64 if dtype == "float64" else np.float32) for t in (tg, tu, tdy)]
    if dtype != "float64":
        from arrays import np_dtype

        host = [h.astype(np_dtype(dtype)) for h in host]
    tol = 1e-12 if dtype == "float64" else (1e-2 if dtype == "bfloat16" else 2e-3)
    got = _fwd(act, host[0], host[1], ref)
    np.testing.assert_allclose(got, y.detach().double().numpy(), rtol=tol, atol=tol)
    rg, ru = _bwd(act, host[2], host[0], host[1], ref)
    np.testing.assert_allclose(rg, dg.double().numpy(), rtol=tol, atol=tol)
    np.testing.assert_allclose(ru, du.double().numpy(), rtol=tol, atol=tol)


def test_reference_rounds_the_activation_to_the_dtype():
    rng = np.random.default_rng(2)
    g, u = random_host(rng, (4, 16), "bfloat16"), random_host(rng, (4, 16), "bfloat16")
    x = g.astype(np.float64)
    s = (x / (1 + np.exp(-x))).astype(g.dtype).astype(np.float64)
    np.testing.assert_array_equal(ref.swiglu(g, u), s * u.astype(np.float64))


# ---- argument checking that needs no GPU ------------------------------------------------------

def bad_input_cases(xp):
    """(call, exception, message pattern) of bad arguments (tests/test_bad_inputs.py runs them)."""
    a = xp.ones((4, 8), np.float32) + xp.arange(8, dtype=np.float32)
    cases = [
        (lambda: cukern.swiglu(a, xp.ones((4, 9), np.float32)), ValueError, r"^up: shape \(4, 9\) does not match"),
        (lambda: cukern.swiglu(a, a.astype(np.float16)), ValueError, "^up: dtype float16 differs from gate's"),
        (lambda: cukern.swiglu(a.astype(np.float64), a.astype(np.float64)), ValueError, "^gate: dtype float64"),
        (lambda: cukern.swiglu(xp.ones((), np.float32), xp.ones((), np.float32)), ValueError,
         "^gate: must have at least one axis"),
        (lambda: cukern.geglu(a, a, approximate="fast"), ValueError, "^approximate: expected 'none' or 'tanh'"),
        (lambda: cukern.swiglu_backward(a[:2], a, a), ValueError, r"^dy: shape \(2, 8\) does not match"),
        (lambda: cukern.swiglu_backward(a.astype(np.float16), a, a), ValueError, "^dy: dtype float16"),
        (lambda: cukern.swiglu(None, a), TypeError, "^gate: required"),
        (lambda: cukern.swiglu(a, [1.0]), TypeError, "^up: "),
        (lambda: cukern.swiglu(np.ones((4, 8), np.float32), a), TypeError, "^gate: a host"),
    ]
    if xp is np:   # NumPy arrays stand in for device arrays here
        cases = [c for c in cases if "host" not in c[2]]
    return cases




# ---- the kernels against the references (GPU) ---------------------------------------------------

def _views(gate, up, framework, layout):
    """Device gate and up: contiguous, the two halves of one (rows, 2H) buffer (row stride 2H),
    or transposed views (copied by the op)."""
    if layout == "fused":
        both = to_device(np.concatenate([gate, up], axis=-1), framework)
        h = gate.shape[-1]
        return both[..., :h], both[..., h:]
    if layout == "transposed" and gate.ndim >= 2:
        def t(a):
            d = to_device(np.ascontiguousarray(np.swapaxes(a, -1, -2)), framework)
            return d.swapaxes(-1, -2) if framework != "torch" else d.transpose(-1, -2)
        return t(gate), t(up)
    return to_device(gate, framework), to_device(up, framework)


@st.composite
def glu_cases(draw):
    cols = draw(st.sampled_from(WIDTHS))
    rows = draw(st.sampled_from([0, 1, 2, 3, 17, 64, 130]))
    shape = (2, rows // 2, cols) if rows > 1 and rows % 2 == 0 and draw(st.booleans()) else (rows, cols)
    return dict(shape=shape, dtype=draw(st.sampled_from(FLOAT_DTYPES)), act=draw(st.sampled_from(ACTS)),
                framework=draw(st.sampled_from(["cupy", "torch"] if torch is not None else ["cupy"])),
                layout=draw(st.sampled_from(["contiguous", "contiguous", "fused", "transposed"])),
                scale=draw(st.sampled_from([1.0, 4.0])), seed=draw(st.integers(0, 2**31 - 1)))


def _run_case(c):
    rng = np.random.default_rng(c["seed"])
    shape, dtype, fw, act = c["shape"], c["dtype"], c["framework"], c["act"]
    g, u, dy = (random_host(rng, shape, dtype, scale=c["scale"]) for _ in range(3))
    gd, ud = _views(g, u, fw, c["layout"])
    poison_allocator(fw, [g.nbytes] * 3)
    y = _fwd(act, gd, ud)
    assert type(y) is type(gd) and tuple(y.shape) == shape
    assert_close(y, _fwd(act, g, u, ref), dtype, "y")
    poison_allocator(fw, [g.nbytes] * 3)
    dg, du = _bwd(act, to_device(dy, fw), gd, ud)
    eg, eu = _bwd(act, dy, g, u, ref)
    assert_close(dg, eg, dtype, "dgate")
    assert_close(du, eu, dtype, "dup")


@gpu
@settings(max_examples=150)
@given(c=glu_cases())
def test_kernels_match_the_reference(c):
    _run_case(c)


@gpu
@pytest.mark.parametrize("act", ACTS)
def test_large_and_extreme_inputs(act):
    """Many rows of the workload's width, and gates far into both tails (exp overflows to inf:
    silu(-100) = -0, not NaN)."""
    _run_case(dict(shape=(3000, 14336), dtype="bfloat16", act=act, framework="cupy", layout="fused", scale=1.0,
                   seed=3))
    import cupy

    g = cupy.asarray(np.array([[-100.0, -30.0, -5.0, 0.0, 5.0, 30.0, 100.0, 1e4]], np.float32))
    u = cupy.ones_like(g)
    y = cupy.asnumpy(_fwd(act, g, u))
    assert np.isfinite(y).all()
    # (GELU's 1 + erf, 1 + tanh cancel in float32 in the left tail, as in PyTorch's kernels: an
    # absolute error of float32's spacing at 1 times |x|)
    np.testing.assert_allclose(y, _fwd(act, cupy.asnumpy(g), cupy.asnumpy(u), ref), rtol=1e-5, atol=1e-6)
    dg, du = (cupy.asnumpy(t) for t in _bwd(act, u, g, u))
    assert np.isfinite(dg).all() and np.isfinite(du).all()


@gpu
@needs_torch
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_against_pytorchs_eager_code_bit_for_bit_mostly(act, dtype):
    """act(gate) * up as PyTorch's two eager ops compute it, forward and autograd: the same
    bits but for rare last-bit differences of the float32 math functions' order of operations."""
    g = torch.Generator(device="cuda").manual_seed(4)
    tdt = getattr(torch, dtype)
    gate, up, dy = ((torch.randn(256, 4096, device="cuda", generator=g) * 2).to(tdt) for _ in range(3))
    gl, ul = gate.clone().requires_grad_(True), up.clone().requires_grad_(True)
    want = _torch_act(act, gl) * ul
    got = _fwd(act, gate, up)
    # (in float32 the last bit of the math functions' results differs with the order of
    # operations; the 16-bit outputs round that away but for rare ties)
    same = 0.99 if dtype != "float32" else 0.5
    assert (got == want).float().mean().item() > same
    assert_close(got, to_host(want), dtype, "y")
    wg, wu = torch.autograd.grad(want, (gl, ul), dy)
    dg, du = _bwd(act, dy, gate, up)
    for name, a, e in (("dgate", dg, wg), ("dup", du, wu)):
        assert (a == e).float().mean().item() > same, name
        assert_close(a, to_host(e), dtype, name)


@pytest.mark.parametrize("shape, dtype, layout, kernel, vec, blocks", [
    ((16384, 14336), "bfloat16", "dense", "flat", 8, 16384 * 14336 // 8 // 256),
    ((3, 5, 33), "float16", "dense", "flat", 1, -(-3 * 5 * 33 // 256)),
    ((7, 2048), "float32", "dense", "flat", 4, 7 * 2048 // 4 // 256),
    ((300, 256), "bfloat16", "fused", "rows", 8, -(-300 // 8)),   # (halves of (300, 512): 8 rows a block)
    ((300, 100), "float32", "fused", "rows", 4, -(-300 // 8)),
])
def test_dense_rows_run_the_flat_kernels(host_arrays_as_device, shape, dtype, layout, kernel, vec, blocks):
    """Dense gate, up and dy take the _flat kernels (one vector a thread over the whole array);
    rows with a stride of their own (a fused projection's halves) the row kernels. On the CPU:
    the plans are built and packed against cuda_src/swiglu.cu's declarations, not run."""
    from conftest import DryRun

    rng = np.random.default_rng(0)
    if layout == "fused":
        both = random_host(rng, shape[:-1] + (2 * shape[-1],), dtype)
        gate, up = both[..., :shape[-1]], both[..., shape[-1]:]
    else:
        gate, up = random_host(rng, shape, dtype), random_host(rng, shape, dtype)
    dy = random_host(rng, shape, dtype)
    for kind, call in (("fwd", lambda: cukern.swiglu(gate, up)), ("bwd", lambda: cukern.swiglu_backward(dy, gate, up))):
        with pytest.raises(DryRun) as run:
            call()
        (launch,) = [s for s in run.value.plan.steps if isinstance(s, tuple)]
        name = launch[1].kernel_name
        assert name == (f"glu_{kind}_flat" if kernel == "flat" else f"glu_{kind}"), name
        assert f", {vec}, 256>" in launch[1].name, launch[1].name
        assert (launch[2] if isinstance(launch[2], int) else launch[2][0]) == blocks
        if kernel == "flat":
            assert launch[4]["nvec"] == np.prod(shape) // vec


@gpu
@pytest.mark.parametrize("framework", ["cupy", "torch"])
def test_empty_inputs_give_empty_outputs(framework):
    if framework == "torch" and torch is None:
        pytest.skip("torch is not installed")
    for shape in ((0, 64), (5, 0)):
        a = to_device(np.ones(shape, np.float32), framework)
        assert tuple(cukern.swiglu(a, a).shape) == shape
        assert all(tuple(t.shape) == shape for t in cukern.swiglu_backward(a, a, a))


@gpu
@needs_torch
def test_cukern_torch_swiglu_trains_like_the_eager_code_and_falls_back_on_the_cpu():
    import cukern.torch as ct

    g = torch.Generator(device="cuda").manual_seed(5)
    fused = torch.randn(64, 2 * 1024, device="cuda", generator=g).bfloat16().requires_grad_(True)
    gate, up = fused.chunk(2, dim=-1)        # (views of one projection: read in place)
    y = ct.swiglu(gate, up)
    (dfused,) = torch.autograd.grad(y, fused, torch.ones_like(y))
    ref_fused = fused.detach().clone().requires_grad_(True)
    rg, ru = ref_fused.chunk(2, dim=-1)
    want = torch.nn.functional.silu(rg) * ru
    (dwant,) = torch.autograd.grad(want, ref_fused, torch.ones_like(want))
    assert_close(y, to_host(want), "bfloat16", "y")
    assert_close(dfused, to_host(dwant), "bfloat16", "dfused")
    cpu = torch.randn(4, 8)
    torch.testing.assert_close(ct.geglu(cpu, cpu, "tanh"), torch.nn.functional.gelu(cpu, approximate="tanh") * cpu)


# ---- the family's rows in the shared PyTorch-path tests ------------------------------------------

def torch_stand_ins() -> dict:
    """op -> (forward, backward) computed by PyTorch on the CPU (the op's wiring is tested)."""
    from torch_helpers import recompute

    names = {0: "silu", 1: "gelu", 2: "gelu_tanh"}

    def fwd(g, u, act):
        return (_torch_act(names[act], g) * u,)

    def bwd(dy, g, u, act):
        return tuple(recompute(lambda g, u: _torch_act(names[act], g) * u, (g, u), dy))

    return {"glu": (fwd, bwd)}


def torch_wiring_calls(which: str, g) -> list:
    """(op, its arguments, PyTorch's same computation, the inputs that may need gradients)."""
    gate = torch.randn(3, 5, 16, generator=g).requires_grad_(which in ("x", "both"))
    up = torch.randn(3, 5, 16, generator=g).requires_grad_(which in ("w", "both"))
    return [("glu", (gate, up, 0), lambda: torch.nn.functional.silu(gate) * up, (gate, up)),
            ("glu", (gate, up, 2), lambda: torch.nn.functional.gelu(gate, approximate="tanh") * up, (gate, up))]


def opcheck_samples() -> list:
    from torch_helpers import leaf

    ops = torch.ops.cukern
    bf = torch.bfloat16
    fused = leaf((6, 128), bf, 2)
    return [(ops.glu.default, (leaf((6, 64), bf, 0), leaf((6, 64), bf, 1), 0)),
            (ops.glu.default, (leaf((4, 3, 40), torch.float32, 0), leaf((4, 3, 40), torch.float32, 1), 1)),
            (ops.glu.default, (fused[:, :64], fused[:, 64:], 2))]


def torch_native_cases() -> dict:
    """Replays from C++ (tests/test_torch_native.py): contiguous, the halves of a fused
    projection, GeGLU."""
    import cukern.torch as ct
    from torch_helpers import leaf

    def halves(f, **kw):
        def call(fused):
            g, u = fused.chunk(2, dim=-1)
            return f(g, u, **kw)
        return call

    return {
        "glu_swiglu": lambda dt: ((leaf((4, 50, 96), dt, 0), leaf((4, 50, 96), dt, 1)), ct.swiglu),
        "glu_fused_halves": lambda dt: ((leaf((300, 2 * 256), dt, 2),), halves(ct.swiglu)),
        "glu_geglu_tanh": lambda dt: ((leaf((7, 1000), dt, 3), leaf((7, 1000), dt, 4)),
                                      lambda g, u: ct.geglu(g, u, "tanh")),
    }
