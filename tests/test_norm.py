"""LayerNorm / RMSNorm: the references (no GPU), argument checking, and the kernels against
the references and against torch (GPU)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import cukern
from cukern import reference as ref

from arrays import (FLOAT_DTYPES, TOL, assert_close, np_dtype, poison_allocator, random_host,
                    spin, to_device, to_host, torch)

gpu = pytest.mark.gpu
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")

# Widths around every configuration boundary of cukern.norm (vector width 8 for 2-byte
# types, 4 for float32; register capacities 32 .. 16384 elements; looped kernels beyond).
WIDTHS = [1, 2, 3, 7, 8, 9, 31, 32, 33, 64, 100, 128, 129, 255, 256, 257, 513, 1000, 1024,
          1025, 2047, 2048, 2049, 4095, 4096, 4104, 8192, 8200, 12288]
WIDE = [16384, 16385, 32768, 65536, 70000]


# ---- the references, no GPU -------------------------------------------------------------------

def _numeric_grad(f, x, eps=1e-6):
    g = np.zeros_like(x)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        xp, xm = x.copy(), x.copy()
        xp[i] += eps
        xm[i] -= eps
        g[i] = (f(xp) - f(xm)) / (2 * eps)
    return g


@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("residual", [False, True])
def test_reference_backward_matches_finite_differences(kind, residual):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 5))
    w = rng.standard_normal(5)
    b = rng.standard_normal(5)
    dy = rng.standard_normal((3, 5))
    dh = rng.standard_normal((3, 5)) if residual else None
    if kind == "layer":
        def loss(xx, ww=w, bb=b):
            return (ref.layer_norm(xx, ww, bb, 1e-5) * dy).sum() + (0 if dh is None else (xx * dh).sum())
        _, mean, rstd = ref.layer_norm(x, w, b, 1e-5, return_stats=True)
        dx, dw, db = ref.layer_norm_backward(dy, x, w, mean, rstd, dresidual=dh)
        np.testing.assert_allclose(db, _numeric_grad(lambda bb: loss(x, w, bb), b), rtol=1e-6, atol=1e-8)
    else:
        def loss(xx, ww=w):
            return (ref.rms_norm(xx, ww, 1e-6) * dy).sum() + (0 if dh is None else (xx * dh).sum())
        _, rstd = ref.rms_norm(x, w, 1e-6, return_stats=True)
        dx, dw = ref.rms_norm_backward(dy, x, w, rstd, dresidual=dh)
    np.testing.assert_allclose(dx, _numeric_grad(loss, x), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(dw, _numeric_grad(lambda ww: loss(x, ww), w), rtol=1e-6, atol=1e-8)


def test_reference_residual_is_rounded_to_the_input_dtype():
    rng = np.random.default_rng(1)
    x = random_host(rng, (4, 16), "float16")
    r = random_host(rng, (4, 16), "float16")
    _, h = ref.rms_norm(x, None, residual=r)
    np.testing.assert_array_equal(h, (x.astype(np.float64) + r).astype(np.float16).astype(np.float64))


@needs_torch
def test_reference_matches_torch_cpu_float64():
    rng = np.random.default_rng(2)
    x, w, b = rng.standard_normal((6, 33)), rng.standard_normal(33), rng.standard_normal(33)
    tx = torch.tensor(x)
    np.testing.assert_allclose(ref.layer_norm(x, w, b, 1e-5), torch.nn.functional.layer_norm(
        tx, (33,), torch.tensor(w), torch.tensor(b), 1e-5).numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(ref.rms_norm(x, w, 1e-6), torch.nn.functional.rms_norm(
        tx, (33,), torch.tensor(w), 1e-6).numpy(), rtol=1e-12, atol=1e-12)


@needs_torch
def test_reference_offset_is_gemmas_one_plus_weight():
    """offset=1: Gemma's RMSNorm, (x / rms) * (1 + w) all in float32 upward, and zero-centred
    gamma for LayerNorm; its gradients are those of the weight w + offset, dweight unchanged."""
    rng = np.random.default_rng(3)
    x, w, b, dy = (rng.standard_normal(s) for s in ((5, 40), 40, 40, (5, 40)))
    tx, tw = torch.tensor(x, requires_grad=True), torch.tensor(w, requires_grad=True)
    gemma = tx * torch.rsqrt(tx.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + tw)
    np.testing.assert_allclose(ref.rms_norm(x, w, 1e-6, offset=1.0), gemma.detach().numpy(), rtol=1e-12, atol=1e-12)
    dx, dw = torch.autograd.grad(gemma, (tx, tw), torch.tensor(dy))
    _, rstd = ref.rms_norm(x, w, 1e-6, offset=1.0, return_stats=True)
    got = ref.rms_norm_backward(dy, x, w, rstd.astype(np.float32), offset=1.0)
    np.testing.assert_allclose(got[0], dx.numpy(), rtol=1e-5, atol=1e-6)   # (rstd rounded to float32)
    np.testing.assert_allclose(got[1], dw.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ref.layer_norm(x, w, b, offset=1.0), ref.layer_norm(x, w + 1.0, b), rtol=1e-12)


def _llama_rms_norm(x, w, eps):
    """Hugging Face's LlamaRMSNorm.forward, as written there."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return w * h.to(x.dtype)


@needs_torch
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_reference_llama_casting_is_hugging_faces_llama_rms_norm(dtype):
    """casting_mode="llama": xhat rounded to the dtype before the weight, forward and autograd."""
    rng = np.random.default_rng(4)
    x, w, dy = random_host(rng, (6, 48), dtype), random_host(rng, (48,), dtype), random_host(rng, (6, 48), dtype)
    tdt = getattr(torch, dtype)
    tx = torch.tensor(x.astype(np.float32)).to(tdt).requires_grad_(True)
    tw = torch.tensor(w.astype(np.float32)).to(tdt).requires_grad_(True)
    y = _llama_rms_norm(tx, tw, 1e-6)
    got, rstd = ref.rms_norm(x, w, 1e-6, casting_mode="llama", return_stats=True)
    assert_close(got, y.float().detach().numpy(), dtype, "y")
    # rounded once more than "gemma" does: the two differ, by about a rounding
    gemma = ref.rms_norm(x, w, 1e-6)
    assert not np.array_equal(got, gemma)
    dx, dw = torch.autograd.grad(y, (tx, tw), torch.tensor(dy.astype(np.float32)).to(tdt))
    gdx, gdw = ref.rms_norm_backward(dy, x, w, rstd.astype(np.float32), casting_mode="llama")
    assert_close(gdx, dx.float().numpy(), dtype, "dx")
    assert_close(gdw, dw.float().numpy(), dtype, "dweight")


def test_reference_none_casting_rounds_rstd_and_float32_is_every_mode():
    rng = np.random.default_rng(5)
    x, w = random_host(rng, (4, 40), "bfloat16"), random_host(rng, (40,), "bfloat16")
    _, rstd = ref.rms_norm(x, w, casting_mode="none", return_stats=True)
    np.testing.assert_array_equal(rstd, rstd.astype(np_dtype("bfloat16")).astype(np.float64))
    x32, w32 = x.astype(np.float32), w.astype(np.float32)
    for mode in ("llama", "none"):
        np.testing.assert_array_equal(ref.rms_norm(x32, w32, casting_mode=mode), ref.rms_norm(x32, w32))


def test_reference_fp8_output_saturates_rounds_and_writes_amax():
    import ml_dtypes

    x = np.array([[1.0, -2.0, 3.0, 100.0]], np.float32)
    amax = np.zeros(1, np.float32)
    y = ref.layer_norm(x, out_dtype="float8_e4m3fn", scale=np.array([1e3], np.float32), amax=amax)
    exact = ref.layer_norm(x)
    assert y.dtype == ml_dtypes.float8_e4m3fn
    np.testing.assert_array_equal(np.abs(y.astype(np.float64)), 448.0)   # saturated, not NaN
    assert amax[0] == np.float32(np.abs(exact).max())
    y = ref.rms_norm(x, out_dtype=ml_dtypes.float8_e5m2, scale=np.array([1.0], np.float32))
    np.testing.assert_array_equal(y, ref.rms_norm(x).astype(ml_dtypes.float8_e5m2))


# ---- degenerate rows: D = 1 and rows of equal elements ----------------------------------------
# On such a row the mean is the element itself and the variance 0, so x_hat is exactly 0: y is
# the bias, the row adds exactly 0 to dweight, and with D = 1 dx is exactly 0. PyTorch gives
# these values (its Welford mean stays exactly x on a constant row); a mean taken as sum / D
# rounds, and so did rstd * g - rstd * mean(g) in the backward.

# (1 and 7: scalar loads, the looped kernel for the fp8 output; 8200: the looped backward;
# 16385 and 20000: the looped forward)
DEGENERATE_WIDTHS = [1, 7, 33, 4096, 8200, 16385, 20000]
# The widths at which torch's F.layer_norm itself gives these exact values: its vectorized kernel
# merges the threads' Welford means as nA·mA + nB·mB, which rounds unless the counts are equal
# (torch 2.11 on an H200: y != b on some constant rows of 8200 and 20000 columns).
TORCH_EXACT_WIDTHS = (1, 7, 33, 4096, 16385)


def constant_rows(rng, rows: int, cols: int, dtype: str) -> np.ndarray:
    """(rows, cols) of dtype, each row one random value repeated, a different one a row (away
    from zero, so that a float32 sum of the row rounds)."""
    return np.repeat(random_host(rng, (rows, 1), dtype, scale=3.0, offset=1.5), cols, axis=1)


def same_bits(out, expect, name: str) -> None:
    """The same values and signs (float64 holds every float32/16-bit value exactly)."""
    out, expect = np.asarray(out, np.float64), np.broadcast_to(np.asarray(expect, np.float64), np.shape(out))
    bad = (out != expect) | (np.signbit(out) != np.signbit(expect))
    assert not bad.any(), (f"{name}: {int(bad.sum())} of {bad.size} differ; first at {np.argwhere(bad)[0]}: "
                           f"{out[bad][0]!r} vs {expect[bad][0]!r}")


@pytest.mark.parametrize("cols", DEGENERATE_WIDTHS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_reference_constant_rows_give_exact_zeros(dtype, cols):
    import ml_dtypes

    rng = np.random.default_rng(cols)
    x, r = constant_rows(rng, 9, cols, dtype), constant_rows(rng, 9, cols, dtype)
    w, b = random_host(rng, (cols,), dtype), random_host(rng, (cols,), dtype)
    bias = np.broadcast_to(b.astype(np.float64), x.shape)
    y, mean, rstd = ref.layer_norm(x, w, b, 1e-5, return_stats=True)
    np.testing.assert_array_equal(mean, x[:, 0].astype(np.float64))
    np.testing.assert_array_equal(rstd, 1.0 / np.sqrt(1e-5))   # (the variance is exactly 0)
    same_bits(y, bias, "y")
    same_bits(ref.layer_norm(x, w, b, 1e-5, offset=1.0), bias, "y, offset")
    same_bits(ref.layer_norm(x, None, None, 1e-5), 0.0, "y, no weight")
    np.testing.assert_array_equal(ref.layer_norm(x, w, None, 1e-5), 0.0)   # (0 times w: either sign)
    y, h, hmean, _ = ref.layer_norm(x, w, b, 1e-5, residual=r, return_stats=True)   # (h's rows: constant)
    np.testing.assert_array_equal(hmean, h[:, 0])
    same_bits(y, bias, "y, residual")
    y8 = ref.layer_norm(x, w, b, 1e-5, out_dtype="float8_e4m3fn", scale=np.array([64.0], np.float32))
    np.testing.assert_array_equal(y8.view(np.uint8), np.clip(bias * 64.0, -448, 448).astype(
        ml_dtypes.float8_e4m3fn).view(np.uint8))

    # the backward, from the statistics as the kernels return them (float32)
    dy, dres = random_host(rng, x.shape, dtype), random_host(rng, x.shape, dtype)
    m32, s32 = mean.astype(np.float32), rstd.astype(np.float32)
    dx, dw, _ = ref.layer_norm_backward(dy, x, w, m32, s32)
    np.testing.assert_array_equal(dw, 0.0)
    # rstd * (g - mean(g)): the true dx of a constant row, no x_hat term
    g = dy.astype(np.float64) * w.astype(np.float64)
    np.testing.assert_array_equal(dx, s32.astype(np.float64)[:, None] * (g - g.sum(-1, keepdims=True) / cols))
    if cols == 1:
        same_bits(dx, 0.0, "dx")
        same_bits(ref.layer_norm_backward(dy, x, w, m32, s32, dresidual=dres)[0], dres, "dx, dresidual")
        same_bits(ref.layer_norm_backward(dy, x, None, m32, s32, offset=0.0)[0], 0.0, "dx, no weight")


@pytest.mark.parametrize("kind, cols, dtype, extra, threads", [
    ("rms", 4096, "bfloat16", {}, 256),                    # a row on 256 threads: rms_exact
    ("rms", 4096, "float16", {"offset": 1.0}, 256),
    ("rms", 4096, "bfloat16", {"out_dtype": "float8_e4m3fn"}, 64),    # 16-bit to fp8: the fp8 table
    ("layer", 4096, "float16", {"out_dtype": "float8_e5m2"}, 64),
    ("layer", 3072, "bfloat16", {"out_dtype": "float8_e4m3fn"}, 64),
    ("layer", 2048, "bfloat16", {"out_dtype": "float8_e4m3fn"}, 128),  # (the fp8 table is fwd's there)
    ("layer", 4096, "float32", {"out_dtype": "float8_e4m3fn"}, 256),   # float32 rows: the shared table
    ("layer", 4096, "bfloat16", {"out_dtype": "float8_e4m3fn", "residual": True}, 128),
    ("rms", 4096, "bfloat16", {"casting_mode": "llama"}, 128),
    ("rms", 4096, "bfloat16", {"residual": True}, 128),
    ("rms", 3072, "bfloat16", {}, 128),                    # a row that does not fill it
    ("rms", 2048, "float32", {}, 128),
    ("layer", 4096, "bfloat16", {}, 128),
])
def test_forward_row_config_by_width_and_variant(host_arrays_as_device, kind, cols, dtype, extra, threads):
    """RMSNorm's plain 16-bit forward takes its exact-fit config (a 4096-column row on 256
    threads); 16-bit rows of 257-512 vectors with an fp8 output and no residual take the fp8
    table's (a row on 64 threads); the rest keep the shared table. On the CPU: the plan is built
    and packed against cuda_src/norm.cu's declarations, not run."""
    from conftest import DryRun

    rng = np.random.default_rng(cols)
    x, w = random_host(rng, (6, cols), dtype), random_host(rng, (cols,), dtype)
    kw = dict(extra)
    if kw.pop("residual", False):
        kw["residual"] = random_host(rng, (6, cols), dtype)
    if "out_dtype" in kw:
        kw.update(scale=np.ones(1, np.float32), amax=np.zeros(1, np.float32))
    with pytest.raises(DryRun) as run:
        if kind == "rms":
            cukern.rms_norm(x, w, **kw)
        else:
            cukern.layer_norm(x, w, random_host(rng, (cols,), dtype), **kw)
    (launch,) = [s for s in run.value.plan.steps if isinstance(s, tuple) and s[0] == "launch"]
    assert launch[1].threads == threads, launch[1].name


@needs_torch
@pytest.mark.parametrize("cols", [1, 7, 33, 1000])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_torch_ops_path_constant_rows_give_exact_zeros(dtype, cols):
    """The variants in PyTorch's own ops (tensors the kernels do not take, here CPU ones, and
    torch.compile): y is the bias and dweight 0 on constant rows, dx 0 when D = 1."""
    import cukern.torch as ct

    rng = np.random.default_rng(cols)
    tdt = getattr(torch, dtype)
    t = lambda a: torch.tensor(a.astype(np.float32)).to(tdt)  # noqa: E731
    x = t(constant_rows(rng, 9, cols, dtype)).requires_grad_(True)
    r = t(constant_rows(rng, 9, cols, dtype))
    w = t(random_host(rng, (cols,), dtype)).requires_grad_(True)
    b = t(random_host(rng, (cols,), dtype))
    y, h = ct.fused_add_layer_norm(x, r, w, b, 1e-5, offset=1.0)
    same_bits(y.detach().double().numpy(), b.double().numpy(), "y")
    dx, dw = torch.autograd.grad(y, (x, w), t(random_host(rng, (9, cols), dtype)))
    np.testing.assert_array_equal(dw.double().numpy(), 0.0)
    if cols == 1:
        same_bits(dx.double().numpy(), 0.0, "dx")


# ---- argument checking that needs no GPU ------------------------------------------------------

@pytest.mark.parametrize("op", [cukern.layer_norm, cukern.rms_norm])
def test_host_array_is_a_type_error_naming_x_and_the_reference(op):
    with pytest.raises(TypeError, match=r"^x: .*host.*cukern\.reference"):
        op(np.ones((2, 4), np.float32))


def test_none_and_foreign_objects_are_type_errors():
    with pytest.raises(TypeError, match="^x: "):
        cukern.layer_norm(None)
    with pytest.raises(TypeError, match="^x: .*list"):
        cukern.rms_norm([[1.0, 2.0]])


@needs_torch
def test_cpu_tensor_is_a_type_error():
    with pytest.raises(TypeError, match=r"^x: a torch tensor on cpu"):
        cukern.layer_norm(torch.ones(2, 4))
    with pytest.raises(TypeError, match=r"^dy: a torch tensor on cpu"):
        cukern.rms_norm_backward(torch.ones(2, 4), torch.ones(2, 4), None, torch.ones(2))


# ---- the kernels against the references (GPU) ---------------------------------------------------

def _layout(host, framework, layout):
    """Device array holding ``host``'s values, contiguous or as a non-contiguous view."""
    if layout == "contiguous":
        return to_device(host, framework)
    if layout == "row_strided":  # rows of a wider buffer: unit last stride, row stride > width
        pad = np.concatenate([host, host[..., :3] if host.shape[-1] >= 3 else host], axis=-1)
        d = to_device(pad, framework)
        return d[..., : host.shape[-1]]
    # "transposed": the last axis is not unit-stride, so the op must copy
    d = to_device(np.ascontiguousarray(np.swapaxes(host, -1, -2)), framework)
    return d.swapaxes(-1, -2) if framework != "torch" else d.transpose(-1, -2)


def _shapes(draw):
    cols = draw(st.sampled_from(WIDTHS))
    rows = draw(st.sampled_from([0, 1, 2, 3, 17, 64, 130]))
    lead = draw(st.sampled_from(["flat", "3d"]))
    if lead == "3d" and rows > 1 and rows % 2 == 0:
        return (2, rows // 2, cols)
    return (rows, cols)


@st.composite
def norm_cases(draw):
    return dict(
        shape=_shapes(draw),
        dtype=draw(st.sampled_from(FLOAT_DTYPES)),
        framework=draw(st.sampled_from(["cupy", "torch"] if torch is not None else ["cupy"])),
        weight=draw(st.booleans()),
        bias=draw(st.booleans()),
        residual=draw(st.booleans()),
        layout=draw(st.sampled_from(["contiguous", "contiguous", "row_strided", "transposed"])),
        offset=draw(st.sampled_from([0.0, 0.0, 3.0])),
        weight_offset=draw(st.sampled_from([0.0, 0.0, 1.0])),   # (Gemma's 1 + w, zero-centred gamma)
        casting=draw(st.sampled_from(["gemma", "gemma", "llama", "none"])),   # (RMSNorm's)
        fp8=draw(st.sampled_from([None, None, None, "float8_e4m3fn", "float8_e5m2"])),
        fp8_scale=draw(st.sampled_from([1.0, 37.5, 3e3, 2e-3])),   # (3e3: most of e4m3 saturates)
        eps=draw(st.sampled_from([1e-5, 1e-6, 1e-2])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def fp8_codes(a) -> np.ndarray:
    """The bytes of an fp8 output (a torch float8 tensor or a CuPy uint8 array) as uint8."""
    if torch is not None and isinstance(a, torch.Tensor):
        return a.view(torch.uint8).cpu().numpy()
    import cupy

    return cupy.asnumpy(a)


def assert_fp8_close(out, expect, name: str) -> None:
    """Each fp8 code equal to the reference's or next to it (the float32 result the kernel
    rounds sits within an ulp of float32 of the float64 one); NaN where the reference is NaN."""
    got = fp8_codes(out).astype(np.int32)
    ref_codes = expect.view(np.uint8).astype(np.int32)
    assert got.shape == ref_codes.shape, f"{name}: shape {got.shape} != reference {ref_codes.shape}"
    mag_g, mag_r = got & 0x7F, ref_codes & 0x7F
    nan = np.isnan(expect.astype(np.float64))
    assert (got[nan] == 0x7F).all(), f"{name}: NaN expected as 0x7f"
    ok = (np.abs(mag_g - mag_r) <= 1) & (((got ^ ref_codes) & 0x80 == 0) | (np.maximum(mag_g, mag_r) <= 1))
    bad = ~ok & ~nan
    assert not bad.any(), (f"{name}: {int(bad.sum())} of {bad.size} fp8 codes off by more than one; first at "
                           f"{np.argwhere(bad)[0]}: {got[bad][0]:#04x} vs {ref_codes[bad][0]:#04x}")


def _run_case(kind, c):
    """Forward and backward of one drawn case, each compared with the reference."""
    rng = np.random.default_rng(c["seed"])
    shape, dtype, fw = c["shape"], c["dtype"], c["framework"]
    if c["layout"] == "transposed" and len(shape) < 2:
        c = dict(c, layout="contiguous")
    cols = shape[-1]
    x = random_host(rng, shape, dtype, offset=c["offset"])
    w = random_host(rng, (cols,), dtype) if c["weight"] else None
    b = random_host(rng, (cols,), dtype) if c["bias"] and kind == "layer" else None
    r = random_host(rng, shape, dtype) if c["residual"] else None
    dy = random_host(rng, shape, dtype)
    dr = random_host(rng, shape, dtype) if c["residual"] else None
    dev = lambda a: None if a is None else to_device(a, fw)  # noqa: E731
    woff = c.get("weight_offset", 0.0) if w is not None else 0.0
    fp8 = c.get("fp8")
    cast = c.get("casting", "gemma") if kind == "rms" and not fp8 else "gemma"
    extra = {}   # the fp8 output's arguments: a scale, and an amax poisoned with a large value
    if fp8:
        scale = np.array([c["fp8_scale"]], np.float32)
        amax_d = to_device(np.array([1e30], np.float32), fw)
        extra = dict(out_dtype=fp8, scale=to_device(scale, fw))

    nbytes = [x.nbytes] * 3 + [x.size // max(cols, 1) * 4] * 2
    poison_allocator(fw, nbytes)
    xd = _layout(x, fw, c["layout"])
    rd = _layout(r, fw, c["layout"]) if r is not None else None
    amax_ref = np.zeros(1, np.float32)
    ref_extra = dict(extra, scale=scale, amax=amax_ref) if fp8 else {}
    if fp8:
        extra["amax"] = amax_d
    if kind == "layer":
        out = cukern.layer_norm(xd, dev(w), dev(b), c["eps"], residual=rd, return_stats=True, offset=woff, **extra)
        expect = ref.layer_norm(x, w, b, c["eps"], residual=r, return_stats=True, offset=woff, **ref_extra)
    else:
        out = cukern.rms_norm(xd, dev(w), c["eps"], residual=rd, return_stats=True, offset=woff,
                              casting_mode=cast, **extra)
        expect = ref.rms_norm(x, w, c["eps"], residual=r, return_stats=True, offset=woff, casting_mode=cast,
                              **ref_extra)
    names = ["y"] + (["h"] if r is not None else []) + (["mean"] if kind == "layer" else []) + ["rstd"]
    for name, o, e in zip(names, out, expect):
        assert type(o) is type(xd), f"{name}: returned {type(o).__name__} for {type(xd).__name__} input"
        if name == "y" and fp8:
            want = getattr(torch, fp8) if fw == "torch" else np.uint8
            assert o.dtype == want, f"y: dtype {o.dtype}, expected {want} for out_dtype {fp8}"
            assert_fp8_close(o, e, "y")
            assert_close(amax_d, amax_ref.astype(np.float64), "float32", "amax")
            continue
        # float32 statistics (casting mode "none": rstd rounded to the dtype)
        tol = (TOL[dtype] if cast == "none" and dtype != "float32" else 2e-5) if name == "rstd" else \
            2e-5 if name == "mean" else None
        if name == "mean":  # a mean near zero has no relative precision: scale by the row's std
            err = np.abs(to_host(o) - e)
            assert not np.isnan(to_host(o)).any(), "mean: NaN"
            assert np.all(err <= 2e-5 * (np.abs(e) + 1.0 / expect[-1])), f"mean: max error {err.max()}"
            continue
        assert_close(o, e, "float32" if name == "rstd" else dtype, name, tol=tol)

    # Backward, from the kernel's own statistics (as training does).
    xin = out[1] if r is not None else xd
    xin_host = expect[1] if r is not None else x
    stats = out[-2:] if kind == "layer" else out[-1:]
    stats_host = [to_host(s) for s in stats]
    poison_allocator(fw, [x.nbytes] * 2 + [cols * 4 * 4096])
    ddr = _layout(dr, fw, c["layout"]) if dr is not None else None
    if kind == "layer":
        grads = cukern.layer_norm_backward(_layout(dy, fw, c["layout"]), xin, dev(w), *stats, dresidual=ddr,
                                           offset=woff)
        expect_g = ref.layer_norm_backward(dy, xin_host, w, *stats_host, dresidual=dr, offset=woff)
        gnames = ["dx", "dweight", "dbias"]
    else:
        grads = cukern.rms_norm_backward(_layout(dy, fw, c["layout"]), xin, dev(w), *stats, dresidual=ddr,
                                         offset=woff, casting_mode=cast)
        expect_g = ref.rms_norm_backward(dy, xin_host, w, *stats_host, dresidual=dr, offset=woff, casting_mode=cast)
        gnames = ["dx", "dweight"]
    # dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) cancels (to zero when D = 1): its
    # error is measured against the scale of rstd * g, as for any float32 evaluation.
    g = dy.astype(np.float64) * (w.astype(np.float64) + woff if w is not None else 1.0)
    dx_scale = float(np.sqrt(np.mean((stats_host[-1].reshape(shape[:-1])[..., None] * g) ** 2))) if g.size else 0.0
    for name, o, e in zip(gnames, grads, expect_g):
        if e is None:
            assert o is None, f"{name}: expected None when weight is None"
            continue
        assert_close(o, e, dtype, name, scale=dx_scale if name == "dx" else 0.0)


@gpu
@settings(max_examples=120)
@given(c=norm_cases())
def test_layer_norm_matches_reference(c):
    _run_case("layer", c)


@gpu
@settings(max_examples=120)
@given(c=norm_cases())
def test_rms_norm_matches_reference(c):
    _run_case("rms", c)


@gpu
@pytest.mark.parametrize("cols", WIDE)
@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_wide_rows(kind, dtype, cols):
    _run_case(kind, dict(shape=(3, cols), dtype=dtype, framework="cupy", weight=True, bias=True,
                         residual=cols % 2 == 0, layout="contiguous", offset=1.0, eps=1e-5, seed=cols))


@gpu
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_many_rows_workload_width(kind):
    """Enough rows that every block of the persistent grid loops several times."""
    _run_case(kind, dict(shape=(20000, 4096), dtype="bfloat16", framework="cupy", weight=True,
                         bias=True, residual=True, layout="contiguous", offset=0.0, eps=1e-5, seed=7))


@gpu
@pytest.mark.parametrize("cols", [2, 33, 1000, 4096, 20000])
@pytest.mark.parametrize("residual", [False, True])
def test_layer_norm_outlier_in_the_first_column_stays_exact(cols, residual):
    """The one-pass statistics are shifted by the row's first element; an outlier there must
    not cost float32 precision (the kernel then takes an exact second pass)."""
    import cupy

    rng = np.random.default_rng(cols)
    x = random_host(rng, (50, cols), "float32")
    x[:, 0] = 3000.0 + np.arange(50)  # 3000 standard deviations from the rest of the row
    x[::7, 0] = x[::7, 1]             # some rows without the outlier, in the same launch
    r = random_host(rng, (50, cols), "float32") if residual else None
    out = cukern.layer_norm(cupy.asarray(x), residual=None if r is None else cupy.asarray(r),
                            return_stats=True)
    expect = ref.layer_norm(x, residual=r, return_stats=True)
    assert_close(out[0], expect[0], "float32", "y")
    assert_close(out[-1], expect[-1], "float32", "rstd", tol=2e-5)


@gpu
def test_poisoning_reaches_the_next_allocation():
    """The poisoning above is only a check if the allocator really hands back NaN memory."""
    import cupy

    poison_allocator("cupy", [4096 * 2])
    assert np.isnan(cupy.asnumpy(cupy.empty(4096 // 2, np.float32))).any()
    if torch is not None:
        poison_allocator("torch", [4096 * 2])
        assert torch.isnan(torch.empty(4096 // 2, device="cuda")).any()


@gpu
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_weight_gradients_are_bitwise_deterministic(kind):
    import cupy

    rng = np.random.default_rng(3)
    x, dy = (cupy.asarray(random_host(rng, (3000, 1024), "float32")) for _ in range(2))
    w = cupy.asarray(random_host(rng, (1024,), "float32"))
    runs = []
    for _ in range(3):
        if kind == "layer":
            _, m, s = cukern.layer_norm(x, w, w, return_stats=True)
            runs.append([cupy.asnumpy(g) for g in cukern.layer_norm_backward(dy, x, w, m, s)])
        else:
            _, s = cukern.rms_norm(x, w, return_stats=True)
            runs.append([cupy.asnumpy(g) for g in cukern.rms_norm_backward(dy, x, w, s)])
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert a.tobytes() == b.tobytes()


# ---- against torch (GPU) -------------------------------------------------------------------

@gpu
@needs_torch
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", [(4, 7, 4096), (300, 1000), (5, 16385)])
@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_against_torch_forward_and_autograd(kind, shape, dtype):
    F = torch.nn.functional
    tdt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(11)
    cols = shape[-1]
    x = torch.randn(shape, device="cuda", dtype=tdt, generator=g, requires_grad=True)
    w = torch.randn(cols, device="cuda", dtype=tdt, generator=g, requires_grad=True)
    b = torch.randn(cols, device="cuda", dtype=tdt, generator=g, requires_grad=True)
    dy = torch.randn(shape, device="cuda", dtype=tdt, generator=g)
    if kind == "layer":
        y_t = F.layer_norm(x, (cols,), w, b, 1e-5)
        grads_t = torch.autograd.grad(y_t, (x, w, b), dy)
        y, mean, rstd = cukern.layer_norm(x.detach(), w.detach(), b.detach(), 1e-5, return_stats=True)
        grads = cukern.layer_norm_backward(dy, x.detach(), w.detach(), mean, rstd)
    else:
        y_t = F.rms_norm(x, (cols,), w, 1e-6)
        grads_t = torch.autograd.grad(y_t, (x, w), dy)
        y, rstd = cukern.rms_norm(x.detach(), w.detach(), 1e-6, return_stats=True)
        grads = cukern.rms_norm_backward(dy, x.detach(), w.detach(), rstd)
    assert isinstance(y, torch.Tensor) and y.device == x.device and y.dtype == x.dtype
    # Two roundings apart at most (torch's and ours): twice the reference tolerance.
    tol = 2 * {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}[dtype]
    assert_close(y, to_host(y_t), dtype, "y", tol=tol)
    for name, a, e in zip(["dx", "dweight", "dbias"], grads, grads_t):
        assert_close(a, to_host(e), dtype, name, tol=max(tol, 1e-4) if name != "dx" else tol)


@gpu
@needs_torch
def test_fused_residual_equals_torch_add_then_norm():
    F = torch.nn.functional
    g = torch.Generator(device="cuda").manual_seed(5)
    x, r = (torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    w = torch.randn(2048, device="cuda", dtype=torch.bfloat16, generator=g)
    y, h = cukern.rms_norm(x, w, 1e-6, residual=r)
    h_t = x + r
    assert torch.equal(h, h_t), "h must be exactly the rounded sum, as torch's add"
    assert_close(y, to_host(F.rms_norm(h_t, (2048,), w, 1e-6)), "bfloat16", "y", tol=2e-2)


# ---- streams (GPU) ---------------------------------------------------------------------------

@gpu
@needs_torch
def test_runs_on_torchs_current_stream():
    """x is written on a side stream after a long spin; a kernel on any other stream would
    read x before the write lands."""
    import cupy

    s = torch.cuda.Stream()
    x = torch.randn(512, 1024, device="cuda")
    expect = torch.randn(512, 1024, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        with cupy.cuda.ExternalStream(s.cuda_stream):
            spin()
        x.copy_(expect)
        y = cukern.layer_norm(x)
        y_ref = torch.nn.functional.layer_norm(expect, (1024,))
    s.synchronize()
    assert_close(y, to_host(y_ref), "float32", "y", tol=1e-5)


@gpu
def test_runs_on_cupys_current_stream():
    import cupy

    rng = np.random.default_rng(4)
    host = random_host(rng, (512, 1024), "float32")
    x = cupy.asarray(random_host(rng, (512, 1024), "float32"))
    new = cupy.asarray(host)
    cupy.cuda.Device().synchronize()
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        spin()
        x[...] = new
        y = cukern.rms_norm(x)
    s.synchronize()
    assert_close(y, ref.rms_norm(host), "float32", "y")


# ---- fp8 output and casting modes (GPU) -----------------------------------------------------------

FP8 = ("float8_e4m3fn", "float8_e5m2")


def _fp8_boundaries(fmt: str) -> np.ndarray:
    """float32 values on and around every rounding boundary of ``fmt``: each code's value, the
    midpoints between neighbours and the float32 numbers next to them, both signs; beyond the
    largest value, infinities, NaN, zeros and float32 subnormals; random bit patterns."""
    import ml_dtypes

    t = getattr(ml_dtypes, fmt)
    vals = np.arange(256, dtype=np.uint8).view(t).astype(np.float64)
    vals = np.unique(vals[np.isfinite(vals) & (vals >= 0)])
    mids = (vals[:-1] + vals[1:]) / 2
    big = float(ml_dtypes.finfo(t).max)
    pts = np.concatenate([vals, mids, [big * 1.0625, big * 1.125, big * 1.2, 1e30, 3e38]]).astype(np.float32)
    near = np.concatenate([pts, np.nextafter(pts, np.float32(np.inf)), np.nextafter(pts, np.float32(0))])
    special = np.array([np.inf, 1e-40, 1e-45, 0.0], np.float32)
    rng = np.random.default_rng(9)
    randbits = rng.integers(0, 2**32, 200000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    out = np.concatenate([near, -near, special, -special, [np.nan, -np.nan], randbits]).astype(np.float32)
    return out[: out.size - out.size % 2]


@gpu
@pytest.mark.parametrize("soft", [False, True], ids=["hardware", "sm80-code"])
@pytest.mark.parametrize("fmt", FP8)
def test_fp8_conversion_matches_ml_dtypes_on_every_boundary(fmt, soft):
    """The conversion every fp8 output uses, on this GPU's hardware and as the code sm_80 runs:
    round to nearest even, saturate to the largest finite value (infinities too), NaN to 0x7f."""
    import cupy
    import ml_dtypes

    from cukern import _fp8

    x = _fp8_boundaries(fmt)
    got = cupy.asnumpy(_fp8.convert(cupy.asarray(x), fmt, soft=soft))
    big = float(ml_dtypes.finfo(getattr(ml_dtypes, fmt)).max)
    nan = np.isnan(x)
    with np.errstate(invalid="ignore"):
        want = np.clip(x, -big, big).astype(getattr(ml_dtypes, fmt)).view(np.uint8)
    # (CuPy flushes float32 subnormals to zero: those inputs give a zero of their sign)
    sub = ~nan & (np.abs(x) < np.float32(1.1754944e-38))
    want = np.where(sub, np.where(np.signbit(x), 0x80, 0x00), want).astype(np.uint8)
    assert (got[nan] == 0x7F).all(), f"NaN codes: {set(got[nan].tolist())}"
    bad = (got != want) & ~nan
    assert not bad.any(), (f"{int(bad.sum())} codes differ; first: {x[bad][0]!r} -> {got[bad][0]:#04x}, "
                           f"ml_dtypes {want[bad][0]:#04x}")


@gpu
@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("cols", [1024, 4096, 20000])
def test_fp8_output_is_the_float32_result_scaled_and_rounded_exactly(fmt, kind, cols):
    """float32 inputs: the fp8 output is exactly the float32 output times the scale, saturated
    and rounded (ml_dtypes), and amax exactly its max |y|: the same arithmetic, one rounding.
    (Widths where both take one kernel: rows of scalar loads take the looped kernel with an fp8
    output, whose sums run in another order; the reference tests cover them.)"""
    import cupy
    import ml_dtypes

    rng = np.random.default_rng(cols)
    x = cupy.asarray(random_host(rng, (64, cols), "float32", scale=3.0))
    w = cupy.asarray(random_host(rng, (cols,), "float32"))
    b = cupy.asarray(random_host(rng, (cols,), "float32"))
    t = getattr(ml_dtypes, fmt)
    big = np.float32(ml_dtypes.finfo(t).max)
    args = (x, w, b) if kind == "layer" else (x, w)
    op = cukern.layer_norm if kind == "layer" else cukern.rms_norm
    y32 = cupy.asnumpy(op(*args))
    for sc in (1.0, 61.0, 3e3, 1e-3):
        scale = cupy.asarray(np.array([sc], np.float32))
        amax = cupy.full(1, -7.0, np.float32)   # (overwritten, not merged with)
        y8 = op(*args, out_dtype=fmt, scale=scale, amax=amax)
        assert y8.dtype == np.uint8 and y8.shape == x.shape
        want = np.clip(y32 * np.float32(sc), -big, big).astype(t).view(np.uint8)
        np.testing.assert_array_equal(cupy.asnumpy(y8), want, err_msg=f"scale {sc}")
        assert float(amax[0]) == float(np.abs(y32).max()), f"amax {float(amax[0])} vs {np.abs(y32).max()}"


@gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("kind", ["layer", "rms"])
@pytest.mark.parametrize("cols", [1024, 4096])
@pytest.mark.parametrize("sign", ["negative", "positive", "all negative"])
def test_fp8_amax_of_16_bit_inputs_is_exact_whichever_sign_holds_it(dtype, kind, cols, sign):
    """16-bit inputs: amax is max |y| whether the largest magnitude is a negative y, a positive
    one, or every y is negative (the kernel takes a signed and an unsigned max of y's bits).
    Rounded to the input dtype, it is the largest |y| of the 16-bit output, which the same
    arithmetic gives. A NaN in the input makes it NaN."""
    import cupy

    rng = np.random.default_rng(cols + len(sign))
    npdt = np_dtype(dtype)
    x = random_host(rng, (96, cols), dtype).astype(np.float32)
    w = np.abs(random_host(rng, (cols,), dtype).astype(np.float32)) + np.float32(0.5)
    b = random_host(rng, (cols,), dtype).astype(np.float32)
    c = cols // 3
    x[37, c] = 12.0   # |xhat| about 11-12 there: with |w| = 6, the largest |y| of the tensor
    w[c] = -6.0 if sign == "negative" else 6.0
    if sign == "all negative":   # (every |xhat w| < 64 but the outlier's)
        w, b = -w, -np.abs(b) - np.float32(64.0)
        if kind == "rms":
            x = np.abs(x) + np.float32(0.25)
    op = cukern.layer_norm if kind == "layer" else cukern.rms_norm

    def args(xh):
        a = [to_device(xh.astype(npdt), "cupy"), to_device(w.astype(npdt), "cupy")]
        return a + [to_device(b.astype(npdt), "cupy")] if kind == "layer" else a

    y16 = to_host(op(*args(x))).astype(np.float32)
    top = np.abs(y16).max()
    assert (y16.min() == -top) == (sign != "positive")
    assert (y16 < 0).all() == (sign == "all negative")
    amax = cupy.full(1, 3e38, np.float32)   # (overwritten, not merged with)
    scale = cupy.asarray(np.array([2.0], np.float32))
    op(*args(x), out_dtype="float8_e4m3fn", scale=scale, amax=amax)
    got = np.float32(float(amax[0]))
    assert got.astype(npdt).astype(np.float32) == top, (got, top)
    x[5, 7] = np.array([0xFFC00000], np.uint32).view(np.float32)[0]   # a NaN, sign bit set
    op(*args(x), out_dtype="float8_e5m2", scale=scale, amax=amax)
    assert np.isnan(float(amax[0]))


@gpu
@needs_torch
@pytest.mark.parametrize("fmt", FP8)
def test_fp8_output_is_a_torch_float8_tensor_and_amax_is_exact_and_propagates_nan(fmt):
    rng = np.random.default_rng(11)
    x = to_device(random_host(rng, (300, 4096), "bfloat16"), "torch")
    w = to_device(random_host(rng, (4096,), "bfloat16"), "torch")
    scale = torch.tensor([16.0], device="cuda")
    amaxes = []
    for _ in range(3):
        amax = torch.full((1,), 5e4, device="cuda")
        y8 = cukern.rms_norm(x, w, out_dtype=getattr(torch, fmt), scale=scale, amax=amax)
        assert y8.dtype == getattr(torch, fmt) and y8.shape == x.shape and y8.is_cuda
        amaxes.append(amax.item())
    y = torch.nn.functional.rms_norm(x.float(), (4096,), w.float(), 1e-6)
    assert amaxes[0] == amaxes[1] == amaxes[2]
    assert abs(amaxes[0] - y.abs().max().item()) <= 1e-5 * amaxes[0]
    ref8 = (y * 16.0).to(getattr(torch, fmt)).float()   # (no value saturates here)
    assert ((y8.float() - ref8).abs() <= ref8.abs() * 0.25 + 2.0**-16).all()   # (one code at most)
    x[7, 100] = float("nan")
    cukern.rms_norm(x, w, out_dtype=fmt, scale=scale, amax=amax)
    assert np.isnan(amax.item())


@gpu
@needs_torch
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("cols", [4096, 33, 20000])
def test_llama_casting_matches_hugging_faces_llama_rms_norm(dtype, cols):
    """casting_mode="llama" against Hugging Face's code (float32 up, weight * xhat.to(dtype)) on
    the GPU, forward and autograd: the outputs equal but for rare roundings of a last bit."""
    rng = np.random.default_rng(cols)
    tdt = getattr(torch, dtype)
    x = to_device(random_host(rng, (64, cols), dtype), "torch").requires_grad_(True)
    w = to_device(random_host(rng, (cols,), dtype), "torch").requires_grad_(True)
    dy = to_device(random_host(rng, (64, cols), dtype), "torch")
    want = _llama_rms_norm(x, w, 1e-6)
    y, rstd = cukern.rms_norm(x.detach(), w.detach(), 1e-6, casting_mode="llama", return_stats=True)
    assert y.dtype == tdt
    same = (y == want).float().mean().item()
    assert same > 0.99, f"only {same:.4f} of the elements equal Hugging Face's"
    assert_close(y, to_host(want), dtype, "y")
    dx, dw = torch.autograd.grad(want, (x, w), dy)
    gdx, gdw = cukern.rms_norm_backward(dy, x.detach(), w.detach(), rstd, casting_mode="llama")
    assert_close(gdx, to_host(dx), dtype, "dx")
    assert_close(gdw, to_host(dw), dtype, "dweight")


# ---- degenerate rows against the reference and torch (GPU) ---------------------------------------

def torch_bits(t) -> np.ndarray:
    """A torch tensor's bit patterns, as integers of its element's width."""
    return t.detach().contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()]).cpu().numpy()


@gpu
@needs_torch
@pytest.mark.parametrize("form", ["affine", "residual", "offset", "plain"])
@pytest.mark.parametrize("cols", DEGENERATE_WIDTHS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_layer_norm_constant_rows_are_exact(dtype, cols, form):
    """Every second row one random value (every row when D = 1), the others random, in one
    launch. On the constant rows: y is the bias bit for bit (0 times the weight without one) and
    the mean the value, as the reference (and torch's F.layer_norm where it is exact); they add
    exactly 0 to dweight; with D = 1 dx is exactly 0 (dresidual with a residual), as torch's
    autograd. The random rows and the gradients still match the reference."""
    F = torch.nn.functional
    rng = np.random.default_rng(cols + len(form))
    rows = 38
    const = slice(None) if cols == 1 else slice(0, None, 2)
    nconst = len(range(rows)[const])
    x = random_host(rng, (rows, cols), dtype, offset=1.5)
    x[const] = constant_rows(rng, nconst, cols, dtype)
    r = dr = None
    if form == "residual":   # (h = x + r: constant where both are)
        r, dr = random_host(rng, (rows, cols), dtype), random_host(rng, (rows, cols), dtype)
        r[const] = constant_rows(rng, nconst, cols, dtype)
    w = None if form == "plain" else random_host(rng, (cols,), dtype)
    b = random_host(rng, (cols,), dtype) if form in ("affine", "residual") else None
    woff = 1.0 if form == "offset" else 0.0
    dy = random_host(rng, (rows, cols), dtype)
    dev = lambda a: None if a is None else to_device(a, "torch")  # noqa: E731

    xd = dev(x)
    out = cukern.layer_norm(xd, dev(w), dev(b), 1e-5, residual=dev(r), return_stats=True, offset=woff)
    expect = ref.layer_norm(x, w, b, 1e-5, residual=r, return_stats=True, offset=woff)
    y, mean, rstd = out[0], out[-2], out[-1]
    xin, xin_host = (out[1], expect[1]) if r is not None else (xd, x)
    same_bits(to_host(y)[const], expect[0][const], "y")
    np.testing.assert_array_equal(to_host(mean)[const], np.asarray(xin_host[const][:, 0], np.float64))
    assert_close(y, expect[0], dtype, "y")
    assert_close(rstd, expect[-1], "float32", "rstd", tol=2e-5)
    # torch from the same h (its add: the same bits) and parameters; its weight + offset is
    # rounded to the dtype, which only the sign of a zero y could show
    if r is not None:
        assert torch.equal(xin, xd + dev(r))
    if cols in TORCH_EXACT_WIDTHS:
        yt = F.layer_norm(xin, (cols,), None if w is None else dev(w) + woff, dev(b), 1e-5)
        if b is not None:
            np.testing.assert_array_equal(torch_bits(y)[const], torch_bits(yt)[const])
        np.testing.assert_array_equal(to_host(y)[const], to_host(yt)[const])

    grads = cukern.layer_norm_backward(dev(dy), xin, dev(w), mean, rstd, dresidual=dev(dr), offset=woff)
    stats = [to_host(mean), to_host(rstd)]
    expect_g = ref.layer_norm_backward(dy, xin_host, w, *stats, dresidual=dr, offset=woff)
    g = dy.astype(np.float64) * (w.astype(np.float64) + woff if w is not None else 1.0)
    assert_close(grads[0], expect_g[0], dtype, "dx", scale=float(np.sqrt(np.mean((stats[1][:, None] * g) ** 2))))
    if cols == 1:
        same_bits(to_host(grads[0]), 0.0 if dr is None else dr, "dx")
    for name, o, e in zip(["dweight", "dbias"], grads[1:], expect_g[1:]):
        assert (o is None) == (e is None), name
        if e is not None:
            assert_close(o, e, dtype, name)

    # the constant rows alone: dweight exactly 0, dx 0 when D = 1; torch's autograd the same
    xc = xin[const].detach().clone().requires_grad_(True)
    dyc = dev(dy[const])
    dx, dw, _ = cukern.layer_norm_backward(dyc, xc.detach(), dev(w), mean[const], rstd[const], offset=woff)
    if w is not None:
        np.testing.assert_array_equal(to_host(dw), 0.0)
    if cols == 1:
        same_bits(to_host(dx), 0.0, "dx")
    if cols in TORCH_EXACT_WIDTHS:
        wl = None if w is None else dev(w).requires_grad_(True)
        want = torch.autograd.grad(F.layer_norm(xc, (cols,), None if w is None else wl + woff, dev(b), 1e-5),
                                   (xc,) if w is None else (xc, wl), dyc)
        if w is not None:
            np.testing.assert_array_equal(to_host(want[1]), 0.0)
        if cols == 1:
            np.testing.assert_array_equal(torch_bits(dx), torch_bits(want[0]))


@gpu
@needs_torch
@pytest.mark.parametrize("cols", [1, 7, 4096, 20000])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_layer_norm_fp8_of_constant_rows_is_the_scaled_bias(dtype, cols):
    """The fp8 output of constant rows: the bias times the scale, rounded (a power-of-two scale:
    the float32 product is exact, so the codes are the reference's), and amax = max |bias|."""
    rng = np.random.default_rng(cols + 1)
    x = constant_rows(rng, 37, cols, dtype)
    w, b = random_host(rng, (cols,), dtype), random_host(rng, (cols,), dtype)
    dev = lambda a: to_device(a, "torch")  # noqa: E731
    scale = np.array([64.0], np.float32)
    for fmt in FP8:
        amax, amax_ref = dev(np.array([1e30], np.float32)), np.zeros(1, np.float32)
        y = cukern.layer_norm(dev(x), dev(w), dev(b), 1e-5, out_dtype=fmt, scale=dev(scale), amax=amax)
        expect = ref.layer_norm(x, w, b, 1e-5, out_dtype=fmt, scale=scale, amax=amax_ref)
        np.testing.assert_array_equal(fp8_codes(y), expect.view(np.uint8))
        assert to_host(amax)[0] == amax_ref[0] == np.abs(b.astype(np.float32)).max()


@gpu
@needs_torch
@pytest.mark.parametrize("cols", [8, 1000, 2048, 4096])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_layer_norm_16_bit_rows_far_from_zero_stay_exact(dtype, cols):
    """16-bit rows at 0, 1.5, 3, 40 and -200 from zero (mean^2 far above the variance, where
    unshifted sums cancel) through every forward row config a width of this size takes: the
    16-bit output, the fp8 outputs (their own table) and the fused residual, against the
    reference."""
    rng = np.random.default_rng(cols + 7)
    dev = lambda a: to_device(a, "torch")  # noqa: E731
    offsets = (0.0, 1.5, 3.0, 40.0, -200.0)
    x = np.concatenate([random_host(rng, (7, cols), dtype, offset=o) for o in offsets])
    r = random_host(rng, x.shape, dtype)
    w, b = random_host(rng, (cols,), dtype), random_host(rng, (cols,), dtype)
    scale = np.array([16.0], np.float32)
    y = cukern.layer_norm(dev(x), dev(w), dev(b), 1e-5)
    assert_close(y, ref.layer_norm(x, w, b, 1e-5), dtype, "y")
    y, h = cukern.layer_norm(dev(x), dev(w), dev(b), 1e-5, residual=dev(r))
    expect = ref.layer_norm(x, w, b, 1e-5, residual=r)
    assert_close(y, expect[0], dtype, "y, residual")
    same_bits(to_host(h), expect[1], "h")
    for fmt in FP8:
        amax, amax_ref = dev(np.array([1e30], np.float32)), np.zeros(1, np.float32)
        y8 = cukern.layer_norm(dev(x), dev(w), dev(b), 1e-5, out_dtype=fmt, scale=dev(scale), amax=amax)
        e8 = ref.layer_norm(x, w, b, 1e-5, out_dtype=fmt, scale=scale, amax=amax_ref)
        assert_fp8_close(y8, e8, f"y {fmt}")
        np.testing.assert_allclose(to_host(amax)[0], amax_ref[0], rtol=2 ** -7)


# ---- cukern.torch: the variants' modules and the fused residual ---------------------------------------

@needs_torch
def test_modules_take_the_variants_and_keep_the_state_dict():
    import cukern.torch as ct

    m = ct.RMSNorm(24, eps=1e-6, offset=1.0)
    assert isinstance(m, torch.nn.RMSNorm) and list(m.state_dict()) == ["weight"]
    assert torch.equal(m.weight, torch.zeros(24))   # (the weight applied starts at 1: Gemma's zeros)
    assert "offset=1.0" in repr(m)
    ln = ct.FusedAddLayerNorm(24, offset=1.0)
    assert isinstance(ln, torch.nn.LayerNorm) and list(ln.state_dict()) == ["weight", "bias"]
    assert list(ct.RMSNorm(24).state_dict()) == list(torch.nn.RMSNorm(24).state_dict())
    with pytest.raises(ValueError, match="^casting_mode: "):
        ct.FusedAddRMSNorm(24, casting_mode="float32")
    with pytest.raises(ValueError, match="^offset: "):
        ct.RMSNorm(24, elementwise_affine=False, offset=1.0)


@needs_torch
@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fused_add_modules_equal_the_add_then_the_norm(device, dtype):
    """FusedAddRMSNorm / FusedAddLayerNorm against h = x + r and the norm written out in torch:
    (y, h) and the gradients of x, r and the weights (the CPU runs PyTorch's ops; the GPU the
    kernels)."""
    import cukern.torch as ct

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    tdt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(3)
    x, r, dy, dh = (torch.randn(6, 130, 256, generator=g).to(device, tdt) for _ in range(4))
    for rms in (True, False):
        kw = dict(offset=1.0, casting_mode="llama") if rms else dict(offset=1.0)
        m = (ct.FusedAddRMSNorm if rms else ct.FusedAddLayerNorm)(256, eps=1e-6, device=device, dtype=tdt, **kw)
        with torch.no_grad():
            m.weight.normal_(generator=torch.Generator(device).manual_seed(1))
        xs, rs = x.clone().requires_grad_(True), r.clone().requires_grad_(True)
        y, h = m(xs, rs)
        xe, re = x.clone().requires_grad_(True), r.clone().requires_grad_(True)
        he = xe + re
        hf = he.float()
        if rms:
            ye = (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(tdt).float() * (m.weight.float() + 1)
        else:
            mu = hf.mean(-1, keepdim=True)
            ye = (hf - mu) * torch.rsqrt((hf - mu).pow(2).mean(-1, keepdim=True) + 1e-6) * (m.weight.float() + 1) \
                + m.bias.float()
        ye = ye.to(tdt)
        assert torch.equal(h, he)
        assert_close(y, to_host(ye), dtype, "y")
        params = list(m.parameters())
        got = torch.autograd.grad((y, h), [xs, rs, *params], (dy, dh))
        want = torch.autograd.grad((ye, he), [xe, re, *params], (dy, dh))
        for name, a, e in zip(["dx", "dresidual", "dweight", "dbias"], got, want):
            assert_close(a, to_host(e), dtype, name, scale=float(e.float().abs().mean()))


# ---- bad inputs (GPU: they need device arrays) ---------------------------------------------------

def bad_input_cases(xp):
    """(call, exception, message pattern) of bad arguments (tests/test_bad_inputs.py runs them)."""
    """(call, exception, message pattern) for arrays of module ``xp`` (CuPy, or NumPy standing
    in for device arrays on the CPU; host-array cases only with CuPy)."""
    x = xp.ones((4, 8), np.float32) + xp.arange(8, dtype=np.float32)
    w = xp.ones(8, np.float32)
    cases = [
        (lambda: cukern.layer_norm(x.astype(np.float64)), ValueError, "^x: dtype float64"),
        (lambda: cukern.rms_norm(x.astype(np.int32)), ValueError, "^x: dtype int32"),
        (lambda: cukern.layer_norm(x, xp.ones(7, np.float32)), ValueError, r"^weight: shape \(7,\)"),
        (lambda: cukern.layer_norm(x, w, xp.ones((8, 1), np.float32)), ValueError, "^bias: shape"),
        (lambda: cukern.layer_norm(x, w.astype(np.float16)), ValueError, "^weight: dtype float16 differs"),
        (lambda: cukern.rms_norm(x, residual=xp.ones((4, 9), np.float32)), ValueError, "^residual: shape"),
        (lambda: cukern.rms_norm(x, w, eps=-1.0), ValueError, "^eps: "),
        (lambda: cukern.rms_norm(x, w, eps=float("nan")), ValueError, "^eps: "),
        (lambda: cukern.rms_norm(x, w, eps="big"), TypeError, "^eps: "),
        (lambda: cukern.rms_norm(x, offset=1.0), ValueError, "^offset: 1.0 is added to the weight, but weight is None"),
        (lambda: cukern.layer_norm(x, w, offset=float("inf")), ValueError, "^offset: must be finite"),
        (lambda: cukern.rms_norm_backward(x, x, w, xp.ones(4, np.float32), offset="one"), TypeError, "^offset: "),
        (lambda: cukern.layer_norm(xp.zeros((), np.float32)), ValueError, "^x: must have at least one axis"),
        (lambda: cukern.layer_norm(x, np.ones(8, np.float32)), TypeError, "^weight: a host"),
        (lambda: cukern.rms_norm_backward(x, x, w, xp.ones(5, np.float32)), ValueError, "^rstd: shape"),
        (lambda: cukern.rms_norm_backward(x, x, w, xp.ones(4, np.float16)), ValueError, "^rstd: dtype float16"),
        (lambda: cukern.layer_norm_backward(x[:2], x, w, xp.ones(4, np.float32), xp.ones(4, np.float32)),
         ValueError, r"^x: shape \(4, 8\) does not match \(2, 8\)"),
        (lambda: cukern.layer_norm_backward(x, x, w, None, xp.ones(4, np.float32)), TypeError, "^mean: required"),
        (lambda: cukern.rms_norm_backward(x, x, w, xp.ones(4, np.float32), dresidual=x[:, :4]),
         ValueError, "^dresidual: shape"),
        (lambda: cukern.rms_norm(x, w, casting_mode="bf16"), ValueError, "^casting_mode: expected one of 'gemma'"),
        (lambda: cukern.rms_norm_backward(x, x, w, xp.ones(4, np.float32), casting_mode=None), ValueError,
         "^casting_mode: "),
        (lambda: cukern.layer_norm(x, out_dtype="float16"), ValueError, "^out_dtype: expected None, x's dtype or"),
        (lambda: cukern.rms_norm(x, out_dtype="float8_e4m3fn"), ValueError, "^scale: required with out_dtype"),
        (lambda: cukern.rms_norm(x, out_dtype="float8_e4m3fn", scale=xp.ones(2, np.float32)), ValueError,
         r"^scale: expected one float32 element, got shape \(2,\)"),
        (lambda: cukern.rms_norm(x, out_dtype="float8_e4m3fn", scale=xp.ones(1, np.float16)), ValueError,
         "^scale: dtype float16"),
        (lambda: cukern.layer_norm(x, amax=xp.ones(1, np.float32)), ValueError, "^amax: applies to an fp8 output"),
        (lambda: cukern.rms_norm(x.astype(np.float16), w.astype(np.float16), casting_mode="llama",
                                 out_dtype="float8_e5m2", scale=xp.ones(1, np.float32)), ValueError,
         "^casting_mode: an fp8 output"),
    ]
    if xp is np:  # NumPy arrays stand in for device arrays here
        cases = [c for c in cases if "host" not in c[2]]
    return cases




@gpu
def test_inputs_on_two_devices_are_an_error():
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    x = cupy.ones((4, 8), np.float32)
    with cupy.cuda.Device(1):
        w = cupy.ones(8, np.float32)
    with pytest.raises(ValueError, match="^weight: on CUDA device 1"):
        cukern.rms_norm(x, w)


@gpu
@pytest.mark.parametrize("framework", ["cupy", "torch"])
def test_empty_inputs_give_empty_outputs(framework):
    if framework == "torch" and torch is None:
        pytest.skip("torch is not installed")
    rng = np.random.default_rng(6)
    x = to_device(random_host(rng, (0, 64), "bfloat16"), framework)
    w = to_device(random_host(rng, (64,), "bfloat16"), framework)
    y, mean, rstd = cukern.layer_norm(x, w, w, return_stats=True)
    assert tuple(y.shape) == (0, 64) and tuple(mean.shape) == (0,) and tuple(rstd.shape) == (0,)
    dx, dw, db = cukern.layer_norm_backward(x, x, w, mean, rstd)
    assert tuple(dx.shape) == (0, 64)
    np.testing.assert_array_equal(to_host(dw), 0)
    np.testing.assert_array_equal(to_host(db), 0)


@gpu
def test_dlpack_objects_are_answered_with_cupy_arrays():
    import cupy

    rng = np.random.default_rng(8)
    host = random_host(rng, (5, 40), "float32")

    class Foreign:  # only the DLPack protocol, nothing CuPy- or torch-specific
        def __init__(self, a):
            self._a = a

        def __dlpack__(self, **kw):
            return self._a.__dlpack__(**kw)

        def __dlpack_device__(self):
            return self._a.__dlpack_device__()

    y = cukern.layer_norm(Foreign(cupy.asarray(host)))
    assert isinstance(y, cupy.ndarray)
    assert_close(y, ref.layer_norm(host), "float32", "y")


# ---- the family's rows in the shared PyTorch-path tests (tests/test_torch_integration.py) ----

def torch_stand_ins() -> dict:
    """op -> (forward, backward) computed by PyTorch on the CPU (the op's wiring is tested)."""
    import torch.nn.functional as F
    from torch_helpers import recompute

    def ln(x, w, b, eps, off=0.0):
        return F.layer_norm(x, x.shape[-1:], None if w is None else w + off, b, eps)

    def rms(x, w, eps, off=0.0):
        return F.rms_norm(x, x.shape[-1:], None if w is None else w + off, eps)

    def ln_bwd(dy, x, w, off, dh=None):
        dx, dw = recompute(lambda x, w: ln(x, w, None, 1e-5, off), (x, w), dy)
        return (dx if dh is None else dx + dh), dw, dy.reshape(-1, dy.shape[-1]).sum(0)

    def rms_bwd(dy, x, w, off, dh=None):
        dx, dw = recompute(lambda x, w: rms(x, w, 1e-6, off), (x, w), dy)
        return (dx if dh is None else dx + dh), dw

    return {
        "layer_norm": (lambda x, w, b, e, off: (ln(x, w, b, e, off), x.mean(-1), x.mean(-1)),
                       lambda dy, x, w, m, r, off: ln_bwd(dy, x, w, off)),
        "rms_norm": (lambda x, w, e, off, c: (rms(x, w, e, off), x.mean(-1)),
                     lambda dy, x, w, r, off, c: rms_bwd(dy, x, w, off)),
        "layer_norm_residual": (lambda x, r, w, b, e, off: (ln(x + r, w, b, e, off), x + r, x.mean(-1), x.mean(-1)),
                                lambda dy, dh, h, w, m, r, off: ln_bwd(dy, h, w, off, dh)),
        "rms_norm_residual": (lambda x, r, w, e, off, c: (rms(x + r, w, e, off), x + r, x.mean(-1)),
                              lambda dy, dh, h, w, r, off, c: rms_bwd(dy, h, w, off, dh)),
    }


def torch_wiring_calls(which: str, g) -> list:
    """(op, its arguments, PyTorch's same computation, the inputs that may need gradients)."""
    import torch.nn.functional as F

    x = torch.randn(3, 5, 16, generator=g).requires_grad_(which in ("x", "both"))
    r = torch.randn(3, 5, 16, generator=g).requires_grad_(which in ("x", "both"))
    w = torch.randn(16, generator=g).requires_grad_(which in ("w", "both"))
    b = torch.randn(16, generator=g).requires_grad_(which == "both")
    return [("layer_norm", (x, w, b, 1e-5, 0.5), lambda: F.layer_norm(x, (16,), w + 0.5, b, 1e-5), (x, w, b)),
            ("rms_norm", (x, w, 1e-6, 0.0, 0), lambda: F.rms_norm(x, (16,), w, 1e-6), (x, w)),
            ("layer_norm_residual", (x, r, w, b, 1e-5, 0.0), lambda: F.layer_norm(x + r, (16,), w, b, 1e-5),
             (x, r, w, b)),
            ("rms_norm_residual", (x, r, w, 1e-6, 1.0, 0), lambda: F.rms_norm(x + r, (16,), w + 1.0, 1e-6), (x, r, w))]


def opcheck_samples() -> list:
    from torch_helpers import leaf

    ops = torch.ops.cukern
    bf = torch.bfloat16
    return [(ops.layer_norm.default, (leaf((6, 64), bf, 0), leaf((64,), bf, 1), leaf((64,), bf, 2), 1e-5, 0.0)),
            (ops.layer_norm.default, (leaf((6, 64), torch.float32, 0), None, None, 1e-5, 0.0)),
            (ops.rms_norm.default, (leaf((6, 64), bf, 0), leaf((64,), bf, 1), 1e-6, 1.0, 0)),
            (ops.rms_norm.default, (leaf((6, 64), bf, 0), leaf((64,), bf, 1), 1e-6, 0.0, 1)),
            (ops.layer_norm_residual.default, (leaf((6, 64), bf, 0), leaf((6, 64), bf, 3), leaf((64,), bf, 1),
                                               leaf((64,), bf, 2), 1e-5, 0.0)),
            (ops.rms_norm_residual.default, (leaf((6, 64), bf, 0), leaf((6, 64), bf, 3), leaf((64,), bf, 1), 1e-6,
                                             0.0, 2))]


def torch_kernel_cases() -> dict:
    """case -> (a drop-in call, forward + backward, and the kernels it must launch, nothing else)."""
    import cukern.torch as ct
    from torch_helpers import leaf

    x, w, b = leaf((512, 1024), torch.bfloat16, 0), leaf((1024,), torch.bfloat16, 1), leaf((1024,), torch.bfloat16, 2)
    dy = leaf((512, 1024), torch.bfloat16, 3).detach()
    kernels = ["norm_bwd", "norm_fwd", "sum_partial_rows"]
    return {"layer_norm": (lambda: torch.autograd.grad(ct.layer_norm(x, (1024,), w, b), (x, w, b), dy), kernels),
            "rms_norm": (lambda: torch.autograd.grad(ct.rms_norm(x, (1024,), w), (x, w), dy), kernels),
            "rms_norm no grad": (lambda: ct.rms_norm(x.detach(), (1024,), w.detach()), ["norm_fwd"]),
            # (the add of the residual stream is in the kernels: no elementwise kernel beside them)
            "fused_add_rms_norm": (lambda: torch.autograd.grad(ct.fused_add_rms_norm(x, dy, w), (x, w), (dy, dy)),
                                   kernels)}


def torch_native_cases() -> dict:
    """Replays from C++ (tests/test_torch_native.py) of the variants and the fused residual
    (y and h stacked: the one output the shared test takes)."""
    import cukern.torch as ct
    from torch_helpers import leaf

    def fused(rms, **kw):
        def call(x, r, w, *b):
            y, h = (ct.fused_add_rms_norm(x, r, w, **kw) if rms else ct.fused_add_layer_norm(x, r, w, *b, **kw))
            return torch.stack((y, h))
        return call

    def gemma(x, w):
        m = ct.RMSNorm(96, eps=1e-6, offset=1.0, casting_mode="llama", device="cuda", dtype=x.dtype)
        return torch.func.functional_call(m, {"weight": w}, (x,))

    return {
        "rms_norm_residual": lambda dt: ((leaf((4, 50, 96), dt, 0), leaf((4, 50, 96), dt, 4), leaf((96,), dt, 1)),
                                         fused(True)),
        "rms_norm_residual_llama_offset": lambda dt: ((leaf((300, 64), dt, 0), leaf((300, 64), dt, 4),
                                                       leaf((64,), dt, 1)), fused(True, offset=1.0,
                                                                                  casting_mode="llama")),
        "layer_norm_residual": lambda dt: ((leaf((4, 50, 96), dt, 0), leaf((4, 50, 96), dt, 4), leaf((96,), dt, 1),
                                            leaf((96,), dt, 2)), fused(False, offset=1.0)),
        "rms_norm_gemma_module": lambda dt: ((leaf((4, 50, 96), dt, 0), leaf((96,), dt, 1)), gemma),
    }
