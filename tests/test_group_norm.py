"""GroupNorm: the reference (no GPU), argument checking, and the kernels against the reference
and against torch (GPU), on contiguous and channels-last layouts."""
from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import cukern
from cukern import _arrays, reference as ref

from arrays import (FLOAT_DTYPES, assert_close, poison_allocator, random_host, to_device,
                    to_host, torch)
from conftest import DryRun

gpu = pytest.mark.gpu
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")
FRAMEWORKS = ["cupy", "torch"] if torch is not None else ["cupy"]


# ---- the reference, no GPU ----------------------------------------------------------------------

def test_reference_backward_matches_finite_differences():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 6, 3, 2))
    w, b = rng.standard_normal(6), rng.standard_normal(6)
    dy = rng.standard_normal(x.shape)
    _, mean, rstd = ref.group_norm(x, 3, w, b, 1e-5, return_stats=True)
    dx, dw, db = ref.group_norm_backward(dy, x, 3, w, mean, rstd)

    def grad(f, a, h=1e-6):
        g = np.zeros_like(a)
        for i in np.ndindex(a.shape):
            ap, am = a.copy(), a.copy()
            ap[i] += h
            am[i] -= h
            g[i] = (f(ap) - f(am)) / (2 * h)
        return g

    np.testing.assert_allclose(dx, grad(lambda a: (ref.group_norm(a, 3, w, b) * dy).sum(), x), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(dw, grad(lambda a: (ref.group_norm(x, 3, a, b) * dy).sum(), w), rtol=1e-6, atol=1e-8)
    np.testing.assert_allclose(db, grad(lambda a: (ref.group_norm(x, 3, w, a) * dy).sum(), b), rtol=1e-6, atol=1e-8)


@needs_torch
@pytest.mark.parametrize("shape, groups", [((3, 8, 5, 7), 4), ((2, 6), 3), ((2, 4, 3, 2, 5), 1), ((1, 5, 9), 5)])
def test_reference_matches_torch_cpu_float64(shape, groups):
    rng = np.random.default_rng(1)
    x, dy = rng.standard_normal(shape), rng.standard_normal(shape)
    w, b = rng.standard_normal(shape[1]), rng.standard_normal(shape[1])
    xt, wt, bt = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
    yt = torch.nn.functional.group_norm(xt, groups, wt, bt, 1e-5)
    yt.backward(torch.tensor(dy))
    y, mean, rstd = ref.group_norm(x, groups, w, b, 1e-5, return_stats=True)
    np.testing.assert_allclose(y, yt.detach().numpy(), rtol=1e-12, atol=1e-12)
    for got, t in zip(ref.group_norm_backward(dy, x, groups, w, mean, rstd), (xt, wt, bt)):
        np.testing.assert_allclose(got, t.grad.numpy(), rtol=1e-10, atol=1e-12)


# ---- degenerate groups: one element, or all elements equal -----------------------------------
# On such a group the mean is the element itself and the variance 0, so x_hat is exactly 0: y
# is the bias, the group adds exactly 0 to dweight, and a group of one element has dx exactly 0.

# ((C, groups), spatial): groups of one element (C = groups, no or unit spatial extent), and of
# 14 to 16·256 elements, on the contiguous and channels-last traversals.
DEGENERATE_GROUPS = [((4, 4), ()), ((8, 8), (1, 1)), ((6, 3), (7,)), ((32, 4), (8, 8)), ((64, 2), (5, 3)),
                     ((512, 32), (16, 16)), ((520, 2), (7,))]


def constant_groups(rng, shape, groups: int, dtype: str) -> np.ndarray:
    """x of ``shape`` and dtype whose every group is one random value repeated, a different
    one a group (away from zero, so that a float32 sum of the group rounds)."""
    n, c = shape[:2]
    v = random_host(rng, (n, groups, 1), dtype, scale=3.0, offset=1.5)
    return np.ascontiguousarray(np.broadcast_to(v, (n, groups, c // groups * math.prod(shape[2:])))).reshape(shape)


def same_bits(out, expect, name: str) -> None:
    """The same values and signs (float64 holds every float32/16-bit value exactly)."""
    out, expect = np.asarray(out, np.float64), np.broadcast_to(np.asarray(expect, np.float64), np.shape(out))
    bad = (out != expect) | (np.signbit(out) != np.signbit(expect))
    assert not bad.any(), (f"{name}: {int(bad.sum())} of {bad.size} differ; first at {np.argwhere(bad)[0]}: "
                           f"{out[bad][0]!r} vs {expect[bad][0]!r}")


@pytest.mark.parametrize("cg, spatial", DEGENERATE_GROUPS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_reference_constant_groups_give_exact_zeros(dtype, cg, spatial):
    (c, g), n = cg, 3
    shape = (n, c) + spatial
    m = c // g * math.prod(spatial)
    rng = np.random.default_rng(c + m)
    x = constant_groups(rng, shape, g, dtype)
    w, b = random_host(rng, (c,), dtype), random_host(rng, (c,), dtype)
    bias = np.broadcast_to(b.astype(np.float64).reshape((1, c) + (1,) * len(spatial)), shape)
    y, mean, rstd = ref.group_norm(x, g, w, b, 1e-5, return_stats=True)
    np.testing.assert_array_equal(mean, x.reshape(n, g, -1)[:, :, 0].astype(np.float64))
    np.testing.assert_array_equal(rstd, 1.0 / np.sqrt(1e-5))   # (the variance is exactly 0)
    same_bits(y, bias, "y")
    same_bits(ref.group_norm(x, g), 0.0, "y, no weight")
    dy = random_host(rng, shape, dtype)
    m32, s32 = mean.astype(np.float32), rstd.astype(np.float32)   # (as the kernels return them)
    dx, dw, _ = ref.group_norm_backward(dy, x, g, w, m32, s32)
    np.testing.assert_array_equal(dw, 0.0)
    if m == 1:
        same_bits(dx, 0.0, "dx")
        same_bits(ref.group_norm_backward(dy, x, g, None, m32, s32)[0], 0.0, "dx, no weight")


def test_reference_rejects_non_dividing_groups():
    with pytest.raises(ValueError, match="num_groups"):
        ref.group_norm(np.ones((2, 6, 4)), 4)


# ---- argument checking that needs no GPU ------------------------------------------------------

def test_host_array_is_a_type_error_naming_x():
    with pytest.raises(TypeError, match=r"^x: .*host.*cukern\.reference"):
        cukern.group_norm(np.ones((2, 4, 3), np.float32), 2)
    with pytest.raises(TypeError, match=r"^x: .*host"):
        cukern.group_norm_backward(np.ones((2, 4, 3), np.float32), np.ones((2, 4, 3), np.float32), 2,
                                   None, None, None)


@needs_torch
def test_cpu_tensor_is_a_type_error():
    with pytest.raises(TypeError, match=r"^x: a torch tensor on cpu"):
        cukern.group_norm(torch.ones(2, 4, 3), 2)


def test_sizes_beyond_32_bits_are_refused(host_arrays_as_device):
    """N, C or a channel's spatial extent of 2**31 or more: a clear error, not a wrapped int."""
    big = 2**31
    for shape in [(1, 16, big), (big, 2), (1, big)]:
        x = np.lib.stride_tricks.as_strided(np.ones(1, np.float16), shape=shape, strides=(0,) * len(shape))
        with pytest.raises(ValueError, match="beyond the kernels' 32-bit range"):
            cukern.group_norm(x, 1 if shape[1] != 16 else 4)
        g = 1 if shape[1] != 16 else 4
        stats = np.zeros((min(shape[0], 4), g), np.float32)
        stats = np.lib.stride_tricks.as_strided(stats, shape=(shape[0], g), strides=(0, 4))
        with pytest.raises(ValueError, match="beyond the kernels' 32-bit range"):
            cukern.group_norm_backward(x, x, g, None, stats, stats)


# ---- the kernels against the reference (GPU) ---------------------------------------------------

def _on_device(host, framework, layout):
    """Device array holding ``host`` (N, C, *S): contiguous, channels-last, or strided (the op
    must copy it)."""
    if layout == "channels_last" and host.ndim >= 3:
        d = to_device(np.ascontiguousarray(np.moveaxis(host, 1, -1)), framework)
        return d.movedim(-1, 1) if framework == "torch" else d.transpose((0, d.ndim - 1) + tuple(range(1, d.ndim - 1)))
    if layout == "strided":
        d = to_device(np.repeat(host, 2, axis=-1), framework)  # every element twice
        return d[..., ::2]
    return to_device(host, framework)


def _layout_of(a) -> str:
    da = _arrays.as_device_array(a, "a")
    if _arrays.is_contiguous(da):
        return "contiguous"
    return "channels_last" if _arrays.is_channels_last(da) else "other"


# (channels, groups): every traversal of group_norm.cu — one channel a group (channel rows cut
# into segments), 16-channel groups, channels-last groups narrower than a vector, of a
# non-power-of-two number of vectors, and wider than one 32-vector chunk.
CHANNEL_GROUPS = [(1, 1), (4, 2), (6, 3), (32, 32), (32, 2), (64, 4), (96, 4), (48, 2), (512, 1),
                  (520, 2), (600, 2), (24, 1), (512, 32)]
SPATIAL = [(), (1,), (7,), (8, 8), (5, 3), (64,), (1, 1), (16, 16), (3, 4, 5), (2, 2, 17), (257,)]


@st.composite
def gn_cases(draw):
    c, g = draw(st.sampled_from(CHANNEL_GROUPS))
    return dict(
        shape=(draw(st.sampled_from([1, 2, 3, 5])), c) + draw(st.sampled_from(SPATIAL)),
        groups=g,
        dtype=draw(st.sampled_from(FLOAT_DTYPES)),
        framework=draw(st.sampled_from(FRAMEWORKS)),
        weight=draw(st.booleans()),
        bias=draw(st.booleans()),
        layout=draw(st.sampled_from(["contiguous", "channels_last", "channels_last", "strided"])),
        dy_layout=draw(st.sampled_from(["same", "contiguous", "channels_last"])),
        offset=draw(st.sampled_from([0.0, 0.0, 5.0])),
        eps=draw(st.sampled_from([1e-5, 1e-6, 1e-2])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _run_case(c):
    rng = np.random.default_rng(c["seed"])
    shape, g, dtype, fw = c["shape"], c["groups"], c["dtype"], c["framework"]
    n, ch = shape[:2]
    x = random_host(rng, shape, dtype, offset=c["offset"])
    w = random_host(rng, (ch,), dtype) if c["weight"] else None
    b = random_host(rng, (ch,), dtype) if c["bias"] else None
    dy = random_host(rng, shape, dtype)
    dev = lambda a: None if a is None else to_device(a, fw)  # noqa: E731

    poison_allocator(fw, [x.nbytes] * 3 + [n * g * 4] * 2)
    xd = _on_device(x, fw, c["layout"])
    y, mean, rstd = cukern.group_norm(xd, g, dev(w), dev(b), c["eps"], return_stats=True)
    ey, emean, erstd = ref.group_norm(x, g, w, b, c["eps"], return_stats=True)
    assert type(y) is type(xd)
    assert tuple(mean.shape) == (n, g) and tuple(rstd.shape) == (n, g)
    if c["layout"] == "channels_last" and _layout_of(xd) == "channels_last":
        assert _layout_of(y) in ("channels_last",), "y should keep x's channels-last layout"
    else:
        assert _layout_of(y) == "contiguous"
    assert_close(y, ey, dtype, "y")
    assert_close(rstd, erstd, "float32", "rstd", tol=2e-5)
    err = np.abs(to_host(mean) - emean)
    assert np.all(err <= 2e-5 * (np.abs(emean) + 1.0 / erstd)), f"mean: max error {err.max()}"

    # Backward from the kernel's own statistics, as training does.
    poison_allocator(fw, [x.nbytes] * 3 + [n * ch * 4] * 2)
    dy_layout = c["layout"] if c["dy_layout"] == "same" else c["dy_layout"]
    dyd = _on_device(dy, fw, dy_layout)
    dx, dw, db = cukern.group_norm_backward(dyd, xd, g, dev(w), mean, rstd)
    edx, edw, edb = ref.group_norm_backward(dy, x, g, w, to_host(mean), to_host(rstd))
    assert _layout_of(dx) == _layout_of(y)
    per_channel = (1, ch) + (1,) * (len(shape) - 2)
    gg = dy.astype(np.float64) * (w.astype(np.float64).reshape(per_channel) if w is not None else 1.0)
    dx_scale = float(np.sqrt(np.mean((to_host(rstd).repeat(ch // g, axis=1).reshape(
        (n, ch) + (1,) * (len(shape) - 2)) * gg) ** 2))) if gg.size else 0.0
    assert_close(dx, edx, dtype, "dx", scale=dx_scale)
    if w is None:
        assert dw is None
    else:
        assert_close(dw, edw, dtype, "dweight")
    assert_close(db, edb, dtype, "dbias")


@gpu
@settings(max_examples=150)
@given(c=gn_cases())
def test_group_norm_matches_reference(c):
    _run_case(c)


@gpu
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_many_groups_loop_over_the_grid(layout, dtype):
    """More groups than blocks in flight: every block takes several groups in turn."""
    _run_case(dict(shape=(16, 256, 32, 32), groups=32, dtype=dtype, framework="cupy", weight=True,
                   bias=True, layout=layout, dy_layout="same", offset=0.5, eps=1e-5, seed=3))


@gpu
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape, groups", [((2, 64, 8, 8), 16), ((3, 32, 5, 7), 8), ((2, 12, 9), 4),
                                           ((2, 128, 6, 6), 8), ((1, 256, 4, 4), 16), ((2, 96, 3, 3), 12)])
def test_channels_last_tiles_of_several_groups(monkeypatch, shape, groups, dtype):
    """Channels-last tiles of 2 and 4 groups a block (chosen at the workload shape, where
    there are many groups): forced here on small shapes, against the reference."""
    import importlib

    import dataclasses

    gn = importlib.import_module("cukern.group_norm")
    monkeypatch.setattr(gn, "CONFIGS", dataclasses.replace(gn.CONFIGS, tiles_per_sm=0))
    for framework in FRAMEWORKS:
        _run_case(dict(shape=shape, groups=groups, dtype=dtype, framework=framework, weight=True,
                       bias=True, layout="channels_last", dy_layout="same", offset=2.0, eps=1e-5,
                       seed=sum(shape) + groups))


# (shape, groups): groups of 4 channels x 72 positions (part of the first stage), of 16 x 1024
# elements (32 and 64 KB buffers), of 40 x 1024 (96 and 192 KB), of 56 x 1024 (128 KB in 16 bits;
# float32's 224 KB takes the two-read kernel), of 96 x 1024 (192 KB; float32's 384 KB: the
# two-read kernel), an odd row count, and 2048 small groups (blocks take several in turn).
STAGED_SHAPES = [((2, 8, 9, 8), 2), ((3, 64, 32, 32), 4), ((2, 320, 32, 32), 8), ((1, 112, 32, 32), 2),
                 ((1, 96, 32, 32), 1), ((2, 24, 5, 40), 3), ((64, 64, 16, 16), 32)]


def _staged_kernels(monkeypatch, threads: int) -> list:
    """Force the staged forward on (at most ``threads`` a block); the instance names the plans
    compile are appended to the returned list."""
    import dataclasses
    import importlib

    gn = importlib.import_module("cukern.group_norm")
    monkeypatch.setattr(gn, "CONFIGS", dataclasses.replace(gn.CONFIGS, fwd_staged=threads))
    names, kernel = [], gn._kernels.kernel

    def spy(inst, device):
        names.append(inst.name)
        return kernel(inst, device)

    monkeypatch.setattr(gn._kernels, "kernel", spy)
    return names


def _staged_fits(shape, groups, dtype) -> bool:
    import importlib

    gn = importlib.import_module("cukern.group_norm")
    group_bytes = shape[1] // groups * math.prod(shape[2:]) * _arrays.DTYPES[dtype][1]
    return gn._staged_smem(group_bytes, 0) is not None   # (every shape above: whole vectors a channel)


@gpu
@pytest.mark.parametrize("threads", [256, 512, 1024])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape, groups", STAGED_SHAPES)
def test_staged_forward_holds_the_group_in_shared_memory(monkeypatch, shape, groups, dtype, threads):
    """The contiguous forward with the group in shared memory (forced on; every buffer size, at
    the thread counts the caps give it), forward and backward against the reference, and the
    kernel the plan took."""
    names = _staged_kernels(monkeypatch, threads)
    _run_case(dict(shape=shape, groups=groups, dtype=dtype, framework="cupy", weight=True, bias=True,
                   layout="contiguous", dy_layout="same", offset=5.0 if threads == 512 else 0.0, eps=1e-5,
                   seed=sum(shape) + threads))
    staged = [n for n in names if n.startswith("group_norm_fwd_staged")]
    assert bool(staged) == _staged_fits(shape, groups, dtype), names


@gpu
@pytest.mark.parametrize("size", [72, 9000])
def test_staged_forward_outlier_first_element_stays_exact(monkeypatch, size):
    """The staged forward's one-pass sums are shifted by the group's first element too: an
    outlier there takes the exact second pass, from shared memory."""
    names = _staged_kernels(monkeypatch, 512)
    rng = np.random.default_rng(size)
    x = random_host(rng, (3, 4, size), "float32")
    x[:, 0, 0] = 3000.0
    x[:, 2, 0] = -3000.0
    y, mean, rstd = cukern.group_norm(to_device(x, "cupy"), 2, return_stats=True)
    ey, _, erstd = ref.group_norm(x, 2, return_stats=True)
    assert any(n.startswith("group_norm_fwd_staged") for n in names), names
    assert_close(y, ey, "float32", "y")
    assert_close(rstd, erstd, "float32", "rstd", tol=2e-5)


@gpu
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_misaligned_views_take_scalar_loads(layout):
    """An x whose data pointer is not 16-byte aligned (a view from the second element)."""
    import cupy

    rng = np.random.default_rng(9)
    x = random_host(rng, (2, 16, 8, 8), "bfloat16")
    if layout == "contiguous":
        buf = cupy.asarray(np.concatenate([x.ravel()[:1], x.ravel()]))
        xd = buf[1:].reshape(x.shape)
    else:
        xl = np.ascontiguousarray(np.moveaxis(x, 1, -1))
        buf = cupy.asarray(np.concatenate([xl.ravel()[:1], xl.ravel()]))
        xd = buf[1:].reshape(xl.shape).transpose(0, 3, 1, 2)
    assert xd.data.ptr % 16
    y, mean, rstd = cukern.group_norm(xd, 4, return_stats=True)
    assert_close(y, ref.group_norm(x, 4), "bfloat16", "y")


@gpu
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("size", [2, 300, 9000, 70000])
def test_outlier_first_element_stays_exact(layout, size):
    """The one-pass statistics are shifted by the group's first element; an outlier there
    must not cost float32 precision (the kernel then takes an exact second pass, which also
    corrects the mean). Contiguous groups of 600 and 18 000 elements take the staged forward,
    the others the two-read kernel (140 000-element groups: long float32 sums a thread)."""
    rng = np.random.default_rng(size)
    x = random_host(rng, (3, 4, size), "float32")
    x[:, 0, 0] = 3000.0   # the first element of each group, in either layout
    x[:, 2, 0] = -3000.0
    xd = _on_device(x, "cupy", layout)
    y, mean, rstd = cukern.group_norm(xd, 2, return_stats=True)
    ey, emean, erstd = ref.group_norm(x, 2, return_stats=True)
    assert_close(y, ey, "float32", "y")
    assert_close(rstd, erstd, "float32", "rstd", tol=2e-5)
    err = np.abs(to_host(mean) - emean)
    assert np.all(err <= 2e-5 * (np.abs(emean) + 1.0 / erstd)), f"mean: max error {err.max()}"


@pytest.mark.parametrize("optin, cc", [(166912, (8, 0)), (101376, (8, 6)), (232448, (9, 0))])
def test_staged_forward_is_planned_where_the_group_fits(host_arrays_as_device, monkeypatch, optin, cc):
    """Which forward the plan launches (no GPU): the staged kernel with the smallest buffer that
    holds the group within the device's opt-in (A100 164 KB, sm_86 99 KB, H100 227 KB), the
    two-read kernel for larger groups, channels-last, unaligned data and rows of a partial vector."""
    from cukern import _kernels

    monkeypatch.setattr(_kernels, "max_shared_memory", lambda device: optin)
    monkeypatch.setattr(_kernels, "compute_capability", lambda device: cc)

    import importlib

    gn = importlib.import_module("cukern.group_norm")

    def launched(x, groups=2):
        gn._FWD.clear()   # (plans assume one device: its opt-in is not in their key)
        with pytest.raises(DryRun) as info:
            cukern.group_norm(x, groups)
        (step,) = [s for s in info.value.plan.steps if isinstance(s, tuple) and s[0] == "launch"]
        return step[1].name, step[2]

    for kb in (1, 20, 40, 80, 120, 160, 192, 250):   # bfloat16 groups of about that many KB
        x = np.ones((3, 2, kb * 512), _arrays._np_dtype("bfloat16"))
        name, grid = launched(x)
        fits = [s for s in (32, 64, 96, 128, 192) if kb <= s and s * 1024 + 1024 <= optin]
        if fits:
            assert name.startswith("group_norm_fwd_staged<") and name.endswith(f", {fits[0] * 1024}>"), (kb, name)
            assert grid == 6   # (one block a group: fewer groups than blocks fit)
        else:
            assert name.startswith("group_norm_fwd<"), (kb, name)
    small = np.ones((3, 4, 8, 8), np.float32)
    assert launched(small)[0].startswith("group_norm_fwd_staged<float, 256, 32768>")
    cl = np.ones((3, 8, 8, 4), np.float32).transpose(0, 3, 1, 2)   # channels-last
    assert launched(cl)[0].startswith("group_norm_fwd<float, true,")
    assert launched(np.ones((3, 4, 6), np.float32))[0].startswith("group_norm_fwd<")   # 6 % 4 != 0
    unaligned = np.ones(3 * 4 * 64 + 1, np.float32)[1:].reshape(3, 4, 64)
    assert launched(unaligned)[0].startswith("group_norm_fwd<")


@gpu
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
def test_gradients_are_bitwise_deterministic(layout):
    rng = np.random.default_rng(3)
    shape = (8, 64, 24, 24)
    x, dy = (_on_device(random_host(rng, shape, "float32"), "cupy", layout) for _ in range(2))
    w = to_device(random_host(rng, (64,), "float32"), "cupy")
    _, m, s = cukern.group_norm(x, 8, w, w, return_stats=True)
    runs = [[to_host(a).tobytes() for a in cukern.group_norm_backward(dy, x, 8, w, m, s)] for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]


# ---- against torch (GPU) -------------------------------------------------------------------

@gpu
@needs_torch
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("shape, groups", [((4, 128, 32, 32), 32), ((2, 64, 7, 9), 8), ((3, 96, 100), 3),
                                           ((2, 32, 4, 4, 4), 32)])
def test_against_torch_forward_and_autograd(shape, groups, layout, dtype):
    F = torch.nn.functional
    tdt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(11)
    x = torch.randn(shape, device="cuda", dtype=tdt, generator=g)
    if layout == "channels_last":
        x = x.movedim(1, -1).contiguous().movedim(-1, 1)
    x.requires_grad_(True)
    w = torch.randn(shape[1], device="cuda", dtype=tdt, generator=g, requires_grad=True)
    b = torch.randn(shape[1], device="cuda", dtype=tdt, generator=g, requires_grad=True)
    dy = torch.randn(shape, device="cuda", dtype=tdt, generator=g)
    y_t = F.group_norm(x, groups, w, b, 1e-5)
    grads_t = torch.autograd.grad(y_t, (x, w, b), dy)
    y, mean, rstd = cukern.group_norm(x.detach(), groups, w.detach(), b.detach(), 1e-5, return_stats=True)
    grads = cukern.group_norm_backward(dy, x.detach(), groups, w.detach(), mean, rstd)
    assert isinstance(y, torch.Tensor) and y.dtype == x.dtype and y.shape == x.shape
    assert _layout_of(y) == layout
    tol = 2 * {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}[dtype]
    assert_close(y, to_host(y_t), dtype, "y", tol=tol)
    for name, a, e in zip(["dx", "dweight", "dbias"], grads, grads_t):
        assert_close(a, to_host(e), dtype, name, tol=max(tol, 1e-4))


def torch_bits(t) -> np.ndarray:
    """A torch tensor's bit patterns (in its logical order), as integers of its element's width."""
    return t.detach().contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()]).cpu().numpy()


@gpu
@needs_torch
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("cg, spatial", DEGENERATE_GROUPS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_constant_groups_are_exact(dtype, cg, spatial, layout):
    """Every second group one random value (every group when a group has one element), the
    others random, in one launch. On the constant groups: y is the bias bit for bit and the
    mean the value, as the reference; without weight and bias y is 0, as torch's F.group_norm.
    A group of one element has dx exactly 0; constant groups add exactly 0 to dweight. The
    random groups and the gradients still match the reference."""
    F = torch.nn.functional
    (c, g), n = cg, 3
    shape = (n, c) + spatial
    m = c // g * math.prod(spatial)
    rng = np.random.default_rng(c + m)
    const = slice(None) if m == 1 else slice(0, None, 2)   # (groups, in each sample)
    xv = random_host(rng, shape, dtype, offset=1.5).reshape(n, g, m)
    xv[:, const] = constant_groups(rng, shape, g, dtype).reshape(n, g, m)[:, const]
    x = xv.reshape(shape)
    w, b = random_host(rng, (c,), dtype), random_host(rng, (c,), dtype)
    dy = random_host(rng, shape, dtype)
    dev = lambda a: None if a is None else to_device(a, "torch")  # noqa: E731
    per_group = lambda a: to_host(a).reshape(n, g, m)[:, const]  # noqa: E731

    xd = _on_device(x, "torch", layout)
    y, mean, rstd = cukern.group_norm(xd, g, dev(w), dev(b), 1e-5, return_stats=True)
    ey, _, _ = ref.group_norm(x, g, w, b, 1e-5, return_stats=True)
    same_bits(per_group(y), ey.reshape(n, g, m)[:, const], "y")
    np.testing.assert_array_equal(to_host(mean)[:, const], xv[:, const, 0].astype(np.float64))
    assert_close(y, ey, dtype, "y")
    y0 = cukern.group_norm(xd, g, None, None, 1e-5)
    same_bits(per_group(y0), 0.0, "y, no weight")
    # torch, where it is exact: (x - mean) * rstd without weight and bias, and with both where
    # the spatial size is 1 (its Welford mean is x). On larger groups with a weight or a bias it
    # computes x * a + (b - mean * a), a = rstd * w, which leaves the rounding of x * a (rstd is
    # 1/sqrt(eps) there): torch 2.11's y is off the bias by up to about an ulp of x * a.
    bits = lambda a: torch_bits(a).reshape(n, g, m)[:, const]  # noqa: E731
    np.testing.assert_array_equal(bits(y0), bits(F.group_norm(xd, g, None, None, 1e-5)))
    if math.prod(spatial) == 1:
        np.testing.assert_array_equal(bits(y), bits(F.group_norm(xd, g, dev(w), dev(b), 1e-5)))

    dyd = _on_device(dy, "torch", layout)
    dx, dw, db = cukern.group_norm_backward(dyd, xd, g, dev(w), mean, rstd)
    edx, edw, edb = ref.group_norm_backward(dy, x, g, w, to_host(mean), to_host(rstd))
    rs = np.repeat(to_host(rstd), c // g, axis=1).reshape((n, c) + (1,) * len(spatial))
    gw = dy.astype(np.float64) * w.astype(np.float64).reshape((1, c) + (1,) * len(spatial))
    assert_close(dx, edx, dtype, "dx", scale=float(np.sqrt(np.mean((rs * gw) ** 2))))
    assert_close(dw, edw, dtype, "dweight")
    assert_close(db, edb, dtype, "dbias")
    if m == 1:
        same_bits(to_host(dx), 0.0, "dx")
        same_bits(to_host(cukern.group_norm_backward(dyd, xd, g, None, mean, rstd)[0]), 0.0, "dx, no weight")

    # every group constant: dweight exactly 0
    xc = _on_device(constant_groups(rng, shape, g, dtype), "torch", layout)
    _, mc, sc = cukern.group_norm(xc, g, dev(w), dev(b), 1e-5, return_stats=True)
    np.testing.assert_array_equal(to_host(cukern.group_norm_backward(dyd, xc, g, dev(w), mc, sc)[1]), 0.0)


# ---- bad inputs and degenerate shapes (GPU: they need device arrays) -----------------------------

def bad_input_cases(xp):
    """(call, exception, message pattern) of bad arguments (tests/test_bad_inputs.py runs them)."""
    """(call, exception, message pattern) for arrays of module ``xp`` (CuPy, or NumPy standing
    in for device arrays on the CPU)."""
    x = xp.arange(2 * 6 * 5, dtype=np.float32).reshape(2, 6, 5)
    w = xp.ones(6, np.float32)
    st_ = xp.ones((2, 3), np.float32)
    return [
        (lambda: cukern.group_norm(x, 4), ValueError, r"^num_groups: 6 channels cannot be split into 4"),
        (lambda: cukern.group_norm(x, 0), ValueError, "^num_groups: must be positive"),
        (lambda: cukern.group_norm(x, 2.0), TypeError, "^num_groups: expected an int"),
        (lambda: cukern.group_norm(x[0, 0], 1), ValueError, r"^x: expected \(N, C, \*spatial\)"),
        (lambda: cukern.group_norm(x.astype(np.float64), 3), ValueError, "^x: dtype float64"),
        (lambda: cukern.group_norm(x, 3, xp.ones(5, np.float32)), ValueError, r"^weight: shape \(5,\)"),
        (lambda: cukern.group_norm(x, 3, w, w.astype(np.float16)), ValueError, "^bias: dtype float16 differs"),
        (lambda: cukern.group_norm(x, 3, eps=-1), ValueError, "^eps: "),
        (lambda: cukern.group_norm_backward(x, x, 3, w, st_, xp.ones((2, 2), np.float32)), ValueError,
         r"^rstd: shape \(2, 2\) does not match \(N, num_groups\) = \(2, 3\)"),
        (lambda: cukern.group_norm_backward(x, x, 3, w, st_.astype(np.float16), st_), ValueError,
         "^mean: dtype float16"),
        (lambda: cukern.group_norm_backward(x[:1], x, 3, w, st_, st_), ValueError, r"^dy: shape \(1, 6, 5\)"),
        (lambda: cukern.group_norm_backward(x, x, 4, w, st_, st_), ValueError, "^num_groups: "),
        (lambda: cukern.group_norm_backward(x, x, 3, w, None, st_), TypeError, "^mean: required"),
    ]




@gpu
@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("shape", [(0, 8, 4, 4), (2, 8, 0), (2, 0, 3)])
def test_empty_inputs(framework, shape):
    rng = np.random.default_rng(6)
    groups = 4 if shape[1] else 1
    x = to_device(random_host(rng, shape, "bfloat16"), framework)
    w = to_device(random_host(rng, (shape[1],), "bfloat16"), framework)
    y, mean, rstd = cukern.group_norm(x, groups, w, w, return_stats=True)
    assert tuple(y.shape) == shape and tuple(mean.shape) == (shape[0], groups)
    dx, dw, db = cukern.group_norm_backward(x, x, groups, w, mean, rstd)
    assert tuple(dx.shape) == shape
    np.testing.assert_array_equal(to_host(dw), 0)
    np.testing.assert_array_equal(to_host(db), 0)


# ---- the family's rows in the shared PyTorch-path tests (tests/test_torch_integration.py) ----

def torch_stand_ins() -> dict:
    import torch.nn.functional as F
    from torch_helpers import recompute

    def stats(x, n):
        return x.reshape(*x.shape[:2], -1).mean(-1)[:, :n]

    return {"group_norm": (lambda x, g, w, b, e: (F.group_norm(x, g, w, b, e), stats(x, g), stats(x, g)),
                           lambda dy, x, g, w, m, r: tuple(recompute(lambda x, w: F.group_norm(x, g, w, None, 1e-5),
                                                                     (x, w), dy)) + (dy.sum((0, 2)),))}


def torch_wiring_calls(which: str, g) -> list:
    import torch.nn.functional as F

    xg = torch.randn(3, 8, 5, generator=g).requires_grad_(which in ("x", "both"))
    wg = torch.randn(8, generator=g).requires_grad_(which in ("w", "both"))
    return [("group_norm", (xg, 4, wg, None, 1e-5), lambda: F.group_norm(xg, 4, wg, None, 1e-5), (xg, wg))]


def opcheck_samples() -> list:
    from torch_helpers import leaf

    ops, bf = torch.ops.cukern, torch.bfloat16
    cl = leaf((2, 8, 5, 3), bf, 0).detach().to(memory_format=torch.channels_last).requires_grad_(True)
    return [(ops.group_norm.default, (leaf((2, 8, 5, 3), bf, 0), 4, leaf((8,), bf, 1), leaf((8,), bf, 2), 1e-5)),
            (ops.group_norm.default, (cl, 2, None, None, 1e-5))]
