"""The mixture-of-experts router and permutation kernels (cukern/moe/routing.py): argument checks
and launch plans without a GPU (every kernel's arguments packed against its declaration), the
compile check, and on the GPU the kernels against the NumPy references (cukern/moe/reference.py),
forward and backward, every dtype, CuPy and torch, edge shapes, bad ids reported."""
from __future__ import annotations

import numpy as np
import pytest

from cukern.moe import reference as R
from cukern.moe import routing

from arrays import (FLOAT_DTYPES, ints_to_device, np_dtype, poison_allocator, to_device, to_host,
                    torch)

gpu = pytest.mark.gpu
FRAMEWORKS = ["cupy"] + (["torch"] if torch is not None else [])


def _distinct_logits(rng, t, e, dtype):
    """Logits whose scores differ by far more than float32's rounding (the kernel and the float64
    reference choose the same experts), exactly representable in ``dtype``."""
    base = np.stack([rng.permutation(e) for _ in range(t)]).astype(np.float64)
    return (base * (4.0 / e) - 2.0).astype(np_dtype(dtype))


# ---- no GPU: checks and plans ----------------------------------------------------------------------

def test_every_call_builds_its_plan_against_the_kernels_declarations(host_arrays_as_device, monkeypatch):
    """Valid calls of each function reach their launch plan on the CPU: each launch's arguments
    packed by name, C type and dtype against cuda_src/moe.cu's declarations."""
    from conftest import DryRun

    from cukern import _faults

    monkeypatch.setattr(_faults, "record", lambda device: np.zeros(3, np.int64))
    rng = np.random.default_rng(0)
    for e, k in ((1, 1), (8, 2), (33, 4), (64, 8), (256, 32)):
        lg = rng.standard_normal((5, e)).astype(np.float32)
        for call in (lambda: routing.moe_router(lg, k),
                     lambda: routing.moe_router(lg, k, score="sigmoid", renormalize=False,
                                                selection_bias=np.zeros(e, np.float32), scale=2.5),
                     lambda: routing.moe_router_backward(np.ones((5, k), np.float32), lg,
                                                         np.zeros((5, k), np.int32))):
            with pytest.raises(DryRun) as run:
                call()
            assert any(s[0] == "launch" for s in run.value.plan.steps if isinstance(s, tuple))
    x = np.ones((7, 10), np.float16)
    ex = np.zeros((7, 3), np.int32)
    rows = np.ones((21, 10), np.float16)
    row_of = np.arange(21, dtype=np.int32)
    w = np.ones((7, 3), np.float32)
    for call in (lambda: routing.moe_permute(x, ex, 4), lambda: routing.moe_permute(x[:, :8], ex, 1024),
                 lambda: routing.moe_unpermute(rows, row_of, w), lambda: routing.moe_permute_backward(rows, row_of, 3),
                 lambda: routing.moe_unpermute_backward(x, rows, row_of, w)):
        with pytest.raises(DryRun):
            call()


def bad_input_cases(xp):
    """(call, exception, message pattern) of the routing's bad arguments (tests/test_moe.py gathers them)."""
    lg = xp.zeros((3, 4), np.float32)
    cases = [
        (lambda: routing.moe_router(lg, 5), ValueError, r"^top_k: must be an int in \[1, 4\]"),
        (lambda: routing.moe_router(xp.zeros((3, 64), np.float32), 33), ValueError, r"^top_k: .*at most 32"),
        (lambda: routing.moe_router(lg, True), ValueError, "^top_k: "),
        (lambda: routing.moe_router(lg, 1, score="relu"), ValueError, "^score: expected one of"),
        (lambda: routing.moe_router(xp.zeros(4, np.float32), 1), ValueError, r"^logits: expected \(tokens, experts\)"),
        (lambda: routing.moe_router(xp.zeros((3, 300), np.float32), 1), ValueError, "^logits: 300 experts"),
        (lambda: routing.moe_router(xp.zeros((4, 3), np.float32).T, 1), ValueError, "^logits: must be contiguous"),
        (lambda: routing.moe_router(lg, 1, selection_bias=xp.zeros(3, np.float32)), ValueError,
         r"^selection_bias: shape \(3,\)"),
        (lambda: routing.moe_router(lg, 1, selection_bias=xp.zeros(4, np.float16)), ValueError,
         "^selection_bias: dtype float16"),
        (lambda: routing.moe_router(lg, 1, scale="2"), TypeError, "^scale: "),
        (lambda: routing.moe_router_backward(xp.zeros((3, 2), np.float32), lg, xp.zeros((3, 2), np.int64)),
         ValueError, "^experts: dtype int64"),
        (lambda: routing.moe_router_backward(xp.zeros((3, 1), np.float32), lg, xp.zeros((3, 2), np.int32)),
         ValueError, r"^dweights: shape \(3, 1\)"),
        (lambda: routing.moe_router_backward(xp.zeros((3, 2), np.float32), lg, xp.zeros((2, 2), np.int32)),
         ValueError, "^experts: 2 tokens, expected 3"),
        (lambda: routing.moe_permute(xp.zeros((3, 8), np.float32), xp.zeros((3, 2), np.int32), 0), ValueError,
         r"^num_experts: must be an int in \[1, 1024\]"),
        (lambda: routing.moe_permute(xp.zeros((3, 8), np.float32), xp.zeros((3, 2), np.int32), 1025), ValueError,
         "^num_experts: "),
        (lambda: routing.moe_permute(xp.zeros(8, np.float32), xp.zeros((3, 2), np.int32), 4), ValueError,
         r"^x: expected \(tokens, hidden\)"),
        (lambda: routing.moe_permute(xp.zeros((3, 8), np.float32), xp.zeros((4, 2), np.int32), 4), ValueError,
         "^experts: 4 tokens, expected 3"),
        (lambda: routing.moe_permute(xp.zeros((3, 8), np.float32), xp.zeros(6, np.int32), 4), ValueError,
         r"^experts: expected \(tokens, top_k\)"),
        (lambda: routing.moe_unpermute(xp.zeros((6, 8), np.float32), xp.zeros(5, np.int32),
                                       xp.zeros((3, 2), np.float32)), ValueError, r"^row_of: shape \(5,\)"),
        (lambda: routing.moe_unpermute(xp.zeros((6, 8), np.float32), xp.zeros(6, np.int32),
                                       xp.zeros((2, 2), np.float32)), ValueError, r"^weights: shape \(2, 2\)"),
        (lambda: routing.moe_permute_backward(xp.zeros((6, 8), np.float32), xp.zeros(6, np.int32), 4), ValueError,
         "^top_k: must be a positive int dividing the 6 rows"),
        (lambda: routing.moe_permute_backward(xp.zeros((6, 8), np.float32), xp.zeros(6, np.int32), True), ValueError,
         "^top_k: must be a positive int"),
        (lambda: routing.moe_router(xp.zeros((0, 300), np.float32), 1), ValueError, "^logits: 300 experts"),
        (lambda: routing.moe_unpermute_backward(xp.zeros((3, 8), np.float16), xp.zeros((6, 8), np.float32),
                                                xp.zeros(6, np.int32), xp.zeros((3, 2), np.float32)), ValueError,
         r"^dout: shape \(3, 8\) float16"),
    ]
    return cases


# ---- GPU: the kernels against the references ----------------------------------------------------

@gpu
@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("e, k", [(1, 1), (8, 2), (33, 5), (64, 8), (128, 8), (256, 32)])
@pytest.mark.parametrize("score, renormalize, biased", [("softmax", True, False), ("softmax", False, False),
                                                        ("sigmoid", True, False), ("sigmoid", False, True)])
def test_router_matches_the_reference(framework, dtype, e, k, score, renormalize, biased):
    rng = np.random.default_rng(e * 100 + k)
    t = 77
    lg = _distinct_logits(rng, t, e, dtype)
    # (a bias of whole steps, 2 apart: score + bias orders as the bias, then the score, in float32
    # as in float64)
    bias = (rng.permutation(e) % 3 * 2.0).astype(np.float32) if biased else None
    w, ex, counts = routing.moe_router(to_device(lg, framework), k, score=score, renormalize=renormalize,
                                       selection_bias=None if bias is None else to_device(bias, framework), scale=1.5)
    rw, rex, rcounts = R.router(lg.astype(np.float64), k, score=score, renormalize=renormalize,
                                selection_bias=bias, scale=1.5)
    np.testing.assert_array_equal(to_host(ex), rex)
    np.testing.assert_array_equal(to_host(counts), rcounts)
    np.testing.assert_allclose(to_host(w), rw, rtol=1e-5, atol=1e-7)
    dw = rng.standard_normal((t, k)).astype(np.float32)
    dl = routing.moe_router_backward(to_device(dw, framework), to_device(lg, framework), ex, score=score,
                                     renormalize=renormalize, scale=1.5)
    want = R.router_backward(dw, lg.astype(np.float64), rex, score=score, renormalize=renormalize, scale=1.5)
    tol = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}[dtype]
    # (measured against the weights' gradient too: one renormalized expert's true gradient is 0,
    # which float32 leaves at a few ulps of dw)
    np.testing.assert_allclose(to_host(dl), want, rtol=tol, atol=tol * max(np.abs(want).max(), np.abs(dw).max()))


@gpu
def test_router_ties_choose_the_lower_expert():
    lg = np.zeros((5, 16), np.float32)
    lg[:, [3, 7, 11]] = 1.0
    _, ex, counts = routing.moe_router(to_device(lg, "cupy"), 4)
    np.testing.assert_array_equal(to_host(ex), np.tile([3, 7, 11, 0], (5, 1)))
    assert to_host(counts).tolist() == [5, 0, 0, 5, 0, 0, 0, 5, 0, 0, 0, 5, 0, 0, 0, 0]


@gpu
@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("t, e, k, h", [(1, 1, 1, 8), (5, 3, 2, 3), (300, 8, 2, 64), (1000, 64, 8, 72),
                                        (3000, 256, 6, 130), (2500, 1024, 4, 16)])
def test_permute_and_combine_match_the_references(framework, dtype, t, e, k, h):
    """The rows placed by expert, stably (chunks of pairs meet at 2048), gathered, combined with
    their weights and back; every output poisoned first."""
    rng = np.random.default_rng(t + e)
    x = (rng.standard_normal((t, h)) + 0.5).astype(np_dtype(dtype))
    # skewed routing: most pairs on the first experts, some experts empty
    ex = np.stack([rng.choice(e, k, replace=False, p=np.arange(e, 0, -1) ** 2 / (np.arange(e, 0, -1) ** 2).sum())
                   for _ in range(t)]).astype(np.int32)
    poison_allocator(framework, [t * k * h * 4, t * k * h * 2, t * k * 4, t * h * 4, t * h * 2])
    xp, order, row_of, offsets, counts = routing.moe_permute(to_device(x, framework), ints_to_device(ex, framework), e)
    rxp, rorder, roff = R.permute(x.astype(np.float64), ex, e)
    np.testing.assert_array_equal(to_host(order), rorder)
    np.testing.assert_array_equal(to_host(offsets), roff)
    np.testing.assert_array_equal(to_host(counts), np.diff(roff))
    inverse = np.empty_like(rorder)
    inverse[rorder] = np.arange(rorder.size)
    np.testing.assert_array_equal(to_host(row_of), inverse)
    np.testing.assert_array_equal(to_host(xp), rxp)   # (a copy: exact)
    w = rng.uniform(0.1, 1.0, (t, k)).astype(np.float32)
    y = (rng.standard_normal((t * k, h))).astype(np_dtype(dtype))
    yd, wd = to_device(y, framework), to_device(w, framework)
    out = routing.moe_unpermute(yd, row_of, wd)
    want = R.unpermute(y.astype(np.float64), rorder, w)
    tol = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 8e-3}[dtype]
    np.testing.assert_allclose(to_host(out), want, rtol=tol, atol=tol * np.abs(want).max())
    dout = rng.standard_normal((t, h)).astype(np_dtype(dtype))
    dy, dw = routing.moe_unpermute_backward(to_device(dout, framework), yd, row_of, wd)
    want_dy = (dout.astype(np.float64)[rorder // k] * w.reshape(-1)[rorder][:, None])
    np.testing.assert_allclose(to_host(dy), want_dy, rtol=tol, atol=tol * np.abs(want_dy).max())
    want_dw = np.einsum("th,tjh->tj", dout.astype(np.float64), y.astype(np.float64)[inverse.reshape(t, k)])
    np.testing.assert_allclose(to_host(dw), want_dw, rtol=1e-5, atol=1e-5 * np.abs(want_dw).max())
    dx = routing.moe_permute_backward(yd, row_of, k)
    want_dx = y.astype(np.float64)[inverse.reshape(t, k)].sum(1)
    np.testing.assert_allclose(to_host(dx), want_dx, rtol=tol, atol=tol * np.abs(want_dx).max())


@gpu
def test_permute_of_no_tokens_gives_empty_rows_and_zero_offsets():
    xp, order, row_of, offsets, counts = routing.moe_permute(to_device(np.ones((0, 8), np.float32), "cupy"),
                                                             ints_to_device(np.zeros((0, 2), np.int32), "cupy"), 4)
    assert to_host(xp).shape == (0, 8) and to_host(order).shape == (0,)
    assert to_host(offsets).tolist() == [0] * 5 and to_host(counts).tolist() == [0] * 4


@gpu
def test_an_expert_id_out_of_range_is_reported_and_never_read_past():
    import cukern

    cukern.check_errors()
    ex = np.array([[0, 1], [5, 2], [1, -1]], np.int32)
    xp, order, row_of, offsets, counts = routing.moe_permute(to_device(np.ones((3, 8), np.float32), "cupy"),
                                                             ints_to_device(ex, "cupy"), 4)
    assert to_host(offsets).tolist() == [0, 1, 3, 4, 4] and to_host(counts).tolist() == [1, 2, 1, 0]
    assert sorted(to_host(order)[4:].tolist()) == [2, 5]   # (after the last expert's rows)
    with pytest.raises(IndexError, match=r"^experts: expert id (5|-1) is out of range for 4 experts"):
        cukern.check_errors()
    rows = to_device(np.ones((6, 8), np.float32), "cupy")
    for row in (99, -1):
        bad = ints_to_device(np.array([0, 1, 2, 3, 4, row], np.int32), "cupy")
        out = routing.moe_unpermute(rows, bad, to_device(np.ones((3, 2), np.float32), "cupy"))
        assert to_host(out)[2].tolist() == [1.0] * 8   # (the bad row not read)
        with pytest.raises(IndexError, match=rf"^row_of / order: row {row} is out of range for 6 rows"):
            cukern.check_errors()
