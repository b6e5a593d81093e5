"""The grouped expert products (cukern/moe/grouped_mm.py): the NumPy reference against PyTorch's
autograd, argument checks and launch plans without a GPU, the compile check, and on the GPU the
three products against the reference: every dtype, CuPy and torch, empty experts, groups that
end inside a tile, partial tiles in every dimension, rows after the last expert, bad offsets
reported."""
from __future__ import annotations

import numpy as np
import pytest

from cukern._plans import PlanCache
from cukern.moe import grouped_mm
from cukern.moe import reference as R

from arrays import TOL, ints_to_device, np_dtype, poison_allocator, to_device, to_host, torch

gpu = pytest.mark.gpu
FRAMEWORKS = ["cupy"] + (["torch"] if torch is not None else [])
DTYPES = ("float16", "bfloat16")


def _offsets(counts, rows=None) -> np.ndarray:
    off = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    assert rows is None or rows >= off[-1]
    return off


# ---- no GPU: the reference, checks and plans ---------------------------------------------------------

def test_reference_backward_matches_torch_autograd():
    if torch is None:
        pytest.skip("needs torch")
    rng = np.random.default_rng(0)
    counts = [3, 0, 5, 1]
    rows = sum(counts) + 2   # (two rows after the last expert: zero outputs, zero d a)
    off = _offsets(counts)
    a, b = rng.standard_normal((rows, 6)), rng.standard_normal((4, 5, 6))
    dout = rng.standard_normal((rows, 5))
    ta, tb = torch.tensor(a, requires_grad=True), torch.tensor(b, requires_grad=True)
    out = torch.cat([ta[off[e]:off[e + 1]] @ tb[e].T for e in range(4)] + [ta[off[-1]:] @ torch.zeros(6, 5,
                                                                                                     dtype=ta.dtype)])
    out.backward(torch.tensor(dout))
    np.testing.assert_allclose(R.grouped_matmul(a, b, off), out.detach().numpy(), rtol=1e-12, atol=1e-12)
    da, db = R.grouped_matmul_backward(dout, a, b, off)
    np.testing.assert_allclose(da, ta.grad.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(db, tb.grad.numpy(), rtol=1e-12, atol=1e-12)
    assert not db[1].any() and not da[-2:].any()


@pytest.mark.parametrize("capability", [(8, 0), (9, 0)])
def test_every_call_builds_its_plan_against_the_kernels_declarations(host_arrays_as_device, monkeypatch, capability):
    """Valid calls reach their launch plan on the CPU: each launch's arguments packed by name, C
    type and dtype against cuda_src/moe_grouped_mm.cu's declarations, and on sm_90 against
    moe_grouped_mm_sm90.cu's (every product there at a shape it takes, tensor maps included)."""
    from conftest import DryRun

    from cukern import _faults, _kernels, _tensormap

    monkeypatch.setattr(_faults, "record", lambda device: np.zeros(3, np.int64))
    monkeypatch.setattr(_kernels, "compute_capability", lambda device: capability)
    monkeypatch.setattr(_tensormap._driver, "encode_tiled", lambda *args: bytes(128))
    for cache in ("_FORWARD", "_BACKWARD"):   # (plans built anew for this capability)
        monkeypatch.setattr(grouped_mm, cache, PlanCache())
    hopper = []
    real = grouped_mm._sm90_instance
    monkeypatch.setattr(grouped_mm, "_sm90_instance", lambda p, *a: hopper.append(p) or real(p, *a))
    for dtype in DTYPES:
        a = np.ones((300, 128), np_dtype(dtype))
        b = np.ones((4, 256, 128), np_dtype(dtype))
        off = _offsets([100, 0, 150, 50])
        dout = np.ones((300, 256), np_dtype(dtype))
        for call in (lambda: grouped_mm.moe_grouped_mm(a, b, off),
                     lambda: grouped_mm.moe_grouped_mm_backward(dout, a, b, off)):
            with pytest.raises(DryRun):
                call()
    assert hopper == (["forward", "da", "db"] * 2 if capability == (9, 0) else [])
    hopper.clear()
    for dtype in DTYPES:   # (b (E, K, N): the forward on d a's kernel, d a on the forward's)
        a = np.ones((300, 128), np_dtype(dtype))
        b = np.ones((4, 128, 256), np_dtype(dtype))
        off = _offsets([100, 0, 150, 50])
        dout = np.ones((300, 256), np_dtype(dtype))
        for call in (lambda: grouped_mm.moe_grouped_mm(a, b, off, b_layout="kn"),
                     lambda: grouped_mm.moe_grouped_mm_backward(dout, a, b, off, b_layout="kn")):
            with pytest.raises(DryRun):
                call()
    assert hopper == (["da", "forward", "db"] * 2 if capability == (9, 0) else [])
    for dtype in DTYPES:
        a = np.ones((300, 64), np_dtype(dtype))
        b = np.ones((4, 136, 64), np_dtype(dtype))
        off = _offsets([100, 0, 150, 50])
        dout = np.ones((300, 136), np_dtype(dtype))
        for call, launches in ((lambda: grouped_mm.moe_grouped_mm(a, b, off), 1),
                               (lambda: grouped_mm.moe_grouped_mm_backward(dout, a, b, off), 2)):
            with pytest.raises(DryRun) as run:
                call()
            assert sum(1 for s in run.value.plan.steps if isinstance(s, tuple) and s[0] == "launch") == launches


def bad_input_cases(xp):
    """(call, exception, message pattern) of the grouped products' bad arguments (tests/test_moe.py gathers them)."""
    f16, f32 = np.float16, np.float32
    a, b, off = xp.ones((10, 16), f16), xp.ones((2, 8, 16), f16), xp.asarray(_offsets([4, 6]))
    cases = [
        (lambda: grouped_mm.moe_grouped_mm(a.astype(f32), b, off), ValueError, "^a: dtype float32"),
        (lambda: grouped_mm.moe_grouped_mm(a, b.astype(np.float32), off), ValueError, "^b: dtype float32"),
        (lambda: grouped_mm.moe_grouped_mm(a[None], b, off), ValueError, r"^a: expected contiguous \(rows, features\)"),
        (lambda: grouped_mm.moe_grouped_mm(a, b[0], off), ValueError, r"^b: expected contiguous \(experts"),
        (lambda: grouped_mm.moe_grouped_mm(a, b[:, :, :8], off), ValueError, r"^b: expected contiguous"),
        (lambda: grouped_mm.moe_grouped_mm(a, b, off[:2]), ValueError, r"^offsets: shape \(2,\); expected"),
        (lambda: grouped_mm.moe_grouped_mm(a, b, off.astype(np.int64)), ValueError, "^offsets: dtype int64"),
        (lambda: grouped_mm.moe_grouped_mm(a, xp.ones((2, 8, 8), f16), off), ValueError, "^b: shape .*in_features"),
        (lambda: grouped_mm.moe_grouped_mm(xp.ones((10, 12), f16), xp.ones((2, 8, 12), f16), off), ValueError,
         "^a: in_features 12 is not a multiple of 8"),
        (lambda: grouped_mm.moe_grouped_mm(a, xp.ones((2, 12, 16), f16), off), ValueError,
         "^b: out_features 12 is not a multiple of 8"),
        (lambda: grouped_mm.moe_grouped_mm(a, xp.ones((0, 8, 16), f16), xp.zeros(1, np.int32)), ValueError,
         "^b: no experts"),
        (lambda: grouped_mm.moe_grouped_mm_backward(xp.ones((10, 16), f16), a, b, off), ValueError,
         r"^dout: shape \(10, 16\)"),
        (lambda: grouped_mm.moe_grouped_mm_backward(xp.ones((10, 8), np.float32), a, b, off), ValueError,
         "^dout: .*float32"),
        (lambda: grouped_mm.moe_grouped_mm(a, b, off, b_layout="kt"), ValueError, "^b_layout: expected one of"),
        (lambda: grouped_mm.moe_grouped_mm(a, b, off, b_layout="kn"), ValueError,
         r"^b: shape \(2, 8, 16\) \(in_features, out_features\); its in_features must be a's 16"),
        (lambda: grouped_mm.moe_grouped_mm_backward(xp.ones((10, 16), f16), a, xp.ones((2, 16, 8), f16), off,
                                                    b_layout="kn"), ValueError, r"^dout: shape \(10, 16\)"),
    ]
    return cases


# ---- GPU: the products against the reference ---------------------------------------------------------

CASES = {   # experts' row counts, N, K, rows after the last expert
    "one row": ([1], 8, 8, 0),
    "empty experts, partial tiles": ([0, 130, 1, 257, 0], 64, 72, 0),
    "rows after the last expert": ([40, 0, 300], 136, 264, 5),
    "skewed, 16 experts": (list((3000 / np.arange(1, 17) ** 1.2).astype(int)), 256, 128, 0),
    "64 experts": ([64 + (7 * e) % 50 for e in range(64)], 384, 512, 0),
    # Hopper's tiles: the forward's 256 columns with a k tail (136 = 2 x 64 + 8) and rows after
    # the last expert; d a's and d b's 384 columns with a k tail of 200 inside each expert's
    # weight (d b: 200 output rows, groups of 200, 3 and 129 rows summed, one expert empty)
    "hopper forward, k tail": ([0, 130, 1, 257, 0, 70], 256, 136, 5),
    "hopper d a, k tail": ([200, 0, 3, 129], 200, 384, 0),
    # d b's last row tile (N 192) with a box of 64 columns wholly past N (TMA reads zeros there)
    "hopper d b, a box past n": ([200, 0, 3, 129], 192, 256, 0),
    # more k stages than the ring holds at BN 256 (the forward's 8, d b's 5 with a partial last)
    "hopper ring wraps": ([300, 0, 70], 256, 512, 0),
    # columns that 128 does not divide (320 and 192: a last tile of 64 columns, the rest of it
    # read as zeros and not stored), as GPT-OSS's 2880
    "hopper, a partial column tile": ([200, 0, 3, 129], 320, 192, 3),
}
PATHS = ("mma.sync", "hopper")


def _hopper_products(counts, n, k, after, layout="nk") -> set:
    """The Hopper kernels a CASES entry's three products take (with b (E, K, N), "kn", the
    forward runs d a's kernel and d a the forward's; d b's columns are then N)."""
    rows = sum(counts) + after
    products = ((("forward", n, k), ("da", k, n), ("db", k, n)) if layout == "nk"
                else (("da", n, k), ("forward", k, n), ("db", n, k)))
    return {p for p, cols, inner in products if rows >= 128 and inner >= 64 and cols % 64 == 0}


@gpu
@pytest.mark.parametrize("layout", grouped_mm.LAYOUTS)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_grouped_products_match_the_reference(framework, dtype, case, path, layout, monkeypatch):
    """Forward, d a and d b against the float64 reference on the same rounded inputs; every
    output poisoned first (an unwritten element shows as NaN). On each path: the mma.sync
    kernels alone, and Hopper's TMA and wgmma kernels where they take the product (the test
    counts the Hopper launches it expects). Both weight layouts: (E, N, K) and (E, K, N)."""
    counts, n, k, after = CASES[case]
    used = []
    if path == "hopper":
        from cukern import _kernels

        if _kernels.compute_capability(0) != (9, 0):
            pytest.skip("the Hopper kernels need an sm_90 GPU")
        if not _hopper_products(counts, n, k, after, layout):
            pytest.skip(f"{case}: no product of this shape takes the Hopper kernels")
        real = grouped_mm._sm90_instance
        monkeypatch.setattr(grouped_mm, "_sm90_instance", lambda p, *a: used.append(p) or real(p, *a))
    monkeypatch.setattr(grouped_mm, "SM80_ONLY", path == "mma.sync")
    for cache in ("_FORWARD", "_BACKWARD"):   # (plans built anew: the launches counted above)
        monkeypatch.setattr(grouped_mm, cache, PlanCache())
    experts = len(counts)
    off = _offsets(counts)
    rows = int(off[-1]) + after
    rng = np.random.default_rng(rows + n + k)
    a = (rng.standard_normal((rows, k)) + 0.25).astype(np_dtype(dtype))
    b = (rng.standard_normal((experts, n, k)) / np.sqrt(k)).astype(np_dtype(dtype))
    dout = rng.standard_normal((rows, n)).astype(np_dtype(dtype))
    poison_allocator(framework, [rows * n * 2, rows * k * 2, experts * n * k * 2])
    ad, bd, od = to_device(a, framework), to_device(b, framework), ints_to_device(off, framework)
    tol = TOL[dtype]

    def close(got, want):
        got = to_host(got)
        assert not np.isnan(got).any()
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(np.abs(want).max(), 1e-3))

    if layout == "kn":   # (the same weights held (E, K, N))
        bd = to_device(np.ascontiguousarray(b.transpose(0, 2, 1)), framework)
    want = R.grouped_matmul(a, b, off)
    close(grouped_mm.moe_grouped_mm(ad, bd, od, b_layout=layout), want)
    da, db = grouped_mm.moe_grouped_mm_backward(to_device(dout, framework), ad, bd, od, b_layout=layout)
    want_da, want_db = R.grouped_matmul_backward(dout, a, b, off)
    close(da, want_da)
    close(db, want_db if layout == "nk" else want_db.transpose(0, 2, 1))
    if after:
        assert not to_host(da)[-after:].any()
    for e in np.flatnonzero(np.asarray(counts) == 0):
        assert not to_host(db)[e].any()
    if path == "hopper":
        assert set(used) == _hopper_products(counts, n, k, after, layout), used


@gpu
def test_offsets_out_of_order_are_reported_and_never_read_past():
    import cukern

    cukern.check_errors()
    a = to_device(np.ones((20, 16), np.float16), "cupy")
    b = to_device(np.ones((3, 8, 16), np.float16), "cupy")
    for bad in ([0, 12, 5, 20], [0, 4, 30, 20], [2, 4, 8, 20], [0, -4, 8, 20]):
        out = grouped_mm.moe_grouped_mm(a, b, ints_to_device(np.array(bad, np.int32), "cupy"))
        da, db = grouped_mm.moe_grouped_mm_backward(to_device(np.ones((20, 8), np.float16), "cupy"), a, b,
                                                    ints_to_device(np.array(bad, np.int32), "cupy"))
        assert to_host(out).shape == (20, 8) and to_host(db).shape == (3, 8, 16) and to_host(da).shape == (20, 16)
        with pytest.raises(IndexError, match=r"^offsets: expert \d's rows are not in order within the 20 rows"):
            cukern.check_errors()


@gpu
@pytest.mark.parametrize("path", PATHS)
def test_offsets_out_of_order_at_hopper_shapes_are_reported_and_never_read_past(path, monkeypatch):
    """The same at shapes every product of which the Hopper kernels take (300 rows, N 256, K
    128), on both paths: the groups' bounds clamped before any tile or TMA coordinate is made."""
    import cukern
    from cukern import _kernels

    if path == "hopper" and _kernels.compute_capability(0) != (9, 0):
        pytest.skip("the Hopper kernels need an sm_90 GPU")
    monkeypatch.setattr(grouped_mm, "SM80_ONLY", path == "mma.sync")
    cukern.check_errors()
    rng = np.random.default_rng(11)
    a = to_device(rng.standard_normal((300, 128)).astype(np.float16), "cupy")
    b = to_device((rng.standard_normal((3, 256, 128)) / 12).astype(np.float16), "cupy")
    dout = to_device(rng.standard_normal((300, 256)).astype(np.float16), "cupy")
    for bad in ([0, 200, 70, 300], [0, 100, 450, 300], [5, 100, 200, 300], [0, -40, 200, 300]):
        off = ints_to_device(np.array(bad, np.int32), "cupy")
        out = grouped_mm.moe_grouped_mm(a, b, off)
        da, db = grouped_mm.moe_grouped_mm_backward(dout, a, b, off)
        assert to_host(out).shape == (300, 256) and to_host(da).shape == (300, 128)
        assert to_host(db).shape == (3, 256, 128)
        with pytest.raises(IndexError, match=r"^offsets: expert \d's rows are not in order within the 300 rows"):
            cukern.check_errors()

