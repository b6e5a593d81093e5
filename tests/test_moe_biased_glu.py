"""GPT-OSS's biased experts around the grouped products (cukern/moe/biased_glu.py): the NumPy
references against PyTorch's autograd, argument checks and launch plans without a GPU, and on
the GPU the four kernels against the references: both dtypes, float32 and 16-bit biases, gate
inputs on both sides of the clamps, empty experts, rows after the last expert, a row of one
vector, poisoned outputs, the same bits on a second call."""
from __future__ import annotations

import numpy as np
import pytest

from cukern.moe import biased_glu
from cukern.moe import reference as R

from arrays import TOL, ints_to_device, np_dtype, poison_allocator, to_device, to_host, torch

gpu = pytest.mark.gpu
FRAMEWORKS = ["cupy"] + (["torch"] if torch is not None else [])
DTYPES = ("float16", "bfloat16")
ALPHA, LIMIT = 1.702, 7.0


def _offsets(counts) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)


# ---- no GPU: the references, checks and plans --------------------------------------------------

def test_references_match_torch_autograd_through_gpt_osss_gate():
    if torch is None:
        pytest.skip("needs torch")
    rng = np.random.default_rng(0)
    counts, after, i = [3, 0, 5, 2], 2, 6
    off = _offsets(counts)
    rows = int(off[-1]) + after
    h = rng.standard_normal((rows, 2 * i)) * 6   # (many past the limit of 7)
    bias = rng.standard_normal((4, 2 * i))
    dz = rng.standard_normal((rows, i))
    th = torch.tensor(h, requires_grad=True)
    tb = torch.tensor(bias, requires_grad=True)
    row_bias = torch.cat([tb[e].expand(counts[e], -1) for e in range(4)] + [torch.zeros(after, 2 * i)])
    hb = th + row_bias
    gate, up = hb[:, ::2].clamp(min=None, max=LIMIT), hb[:, 1::2].clamp(min=-LIMIT, max=LIMIT)
    z = (up + 1) * (gate * torch.sigmoid(gate * ALPHA))
    z.backward(torch.tensor(dz))
    assert (hb[:, ::2] > LIMIT).any() and (hb[:, 1::2] < -LIMIT).any()
    np.testing.assert_allclose(R.biased_glu(h, bias, off, ALPHA, LIMIT), z.detach().numpy(), rtol=1e-12, atol=1e-12)
    dh, dbias = R.biased_glu_backward(dz, h, bias, off, ALPHA, LIMIT)
    np.testing.assert_allclose(dh, th.grad.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(dbias, tb.grad.numpy(), rtol=1e-12, atol=1e-12)
    assert not dbias[1].any()
    y = rng.standard_normal((rows, 8))
    b8 = rng.standard_normal((4, 8))
    want = y.copy()
    for e in range(4):
        want[off[e]:off[e + 1]] += b8[e]
    np.testing.assert_array_equal(R.group_bias(y, b8, off), want)
    np.testing.assert_allclose(R.group_sums(y, off, 4)[2], y[3:8].sum(0), rtol=1e-13)


def test_every_call_builds_its_plan_against_the_kernels_declarations(host_arrays_as_device):
    from conftest import DryRun

    for dtype in DTYPES:
        for bias_dtype in ("float32", dtype):
            h = np.ones((40, 48), np_dtype(dtype))
            b = np.ones((3, 48), np_dtype(bias_dtype))
            off = _offsets([10, 0, 25])
            calls = [(lambda: biased_glu.moe_biased_glu(h, b, off, ALPHA, LIMIT), 1),
                     (lambda: biased_glu.moe_biased_glu_backward(np.ones((40, 24), np_dtype(dtype)), h, b, off, ALPHA,
                                                                 LIMIT), 2),
                     (lambda: biased_glu.moe_group_bias(h, b, off), 1),
                     (lambda: biased_glu.moe_group_sums(h, off, 3), 1)]
            for call, launches in calls:
                with pytest.raises(DryRun) as run:
                    call()
                assert sum(1 for s in run.value.plan.steps if isinstance(s, tuple) and s[0] == "launch") == launches


def bad_input_cases(xp):
    """(call, exception, message pattern) of the biased experts' kernels' bad arguments
    (tests/test_moe.py gathers them)."""
    f16, f32 = np.float16, np.float32
    h, b, off = xp.ones((10, 16), f16), xp.ones((2, 16), f32), xp.asarray(_offsets([4, 6]))
    glu, bwd = biased_glu.moe_biased_glu, biased_glu.moe_biased_glu_backward
    return [
        (lambda: glu(h.astype(f32), b, off, ALPHA, LIMIT), ValueError, "^h: dtype float32; expected float16"),
        (lambda: glu(xp.ones((10, 24), f16), xp.ones((2, 24), f32), off, ALPHA, LIMIT), ValueError,
         "^h: 24 columns, not a multiple of 16"),
        (lambda: glu(h, xp.ones((2, 8), f32), off, ALPHA, LIMIT), ValueError, r"^bias: shape \(2, 8\); expected"),
        (lambda: glu(h, b[None], off, ALPHA, LIMIT), ValueError, r"^bias: shape \(1, 2, 16\)"),
        (lambda: glu(xp.ones((10, 16), np.float16), xp.ones((2, 16), np.int32), off, ALPHA, LIMIT), ValueError,
         "^bias: dtype"),
        (lambda: glu(h, b, off[:2], ALPHA, LIMIT), ValueError, r"^offsets: shape \(2,\); expected"),
        (lambda: glu(h, b, off, 0.0, LIMIT), ValueError, "^alpha: must be a positive finite number"),
        (lambda: glu(h, b, off, ALPHA, float("inf")), ValueError, "^limit: must be a positive finite number"),
        (lambda: bwd(xp.ones((10, 16), f16), h, b, off, ALPHA, LIMIT), ValueError, r"^dz: shape \(10, 16\)"),
        (lambda: biased_glu.moe_group_bias(xp.ones((10, 12), f16), xp.ones((2, 12), f32), off), ValueError,
         "^y: 12 columns, not a multiple of 8"),
        (lambda: biased_glu.moe_group_sums(h, off, 3), ValueError, r"^offsets: shape \(3,\); expected"),
        (lambda: biased_glu.moe_group_sums(h, off, 0), ValueError, "^experts: must be an int"),
    ]


# ---- GPU: the kernels against the references ---------------------------------------------------

CASES = {   # experts' row counts, I, rows after the last expert
    "one vector a row": ([3, 0, 2], 8, 1),
    "empty experts, rows after the last": ([0, 70, 1, 0, 40], 24, 5),
    "wide rows": ([33, 90], 1440, 0),
    "many experts": ([(7 * e) % 11 for e in range(40)], 64, 3),
}


@gpu
@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("bias_dtype", ["float32", "same"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(CASES))
def test_kernels_match_the_references(case, dtype, bias_dtype, framework):
    """Every output poisoned first (an unwritten element shows as NaN); gate inputs from a
    spread of 6 (many past the limit of 7, on both sides); a second call gives the same bits."""
    counts, i, after = CASES[case]
    off = _offsets(counts)
    rows, experts = int(off[-1]) + after, len(counts)
    rng = np.random.default_rng(rows + i)
    bdt = np.float32 if bias_dtype == "float32" else np_dtype(dtype)
    h = (rng.standard_normal((rows, 2 * i)) * 6).astype(np_dtype(dtype))
    bias = rng.standard_normal((experts, 2 * i)).astype(bdt)
    dz = rng.standard_normal((rows, i)).astype(np_dtype(dtype))
    y = rng.standard_normal((rows, 2 * i)).astype(np_dtype(dtype))
    poison_allocator(framework, [rows * i * 2, rows * i * 4, experts * i * 8])
    hd, bd, od, dzd = (to_device(h, framework), to_device(bias, framework), ints_to_device(off, framework),
                       to_device(dz, framework))
    tol = TOL[dtype]

    def close(got, want, name, atol=None):
        got = to_host(got).astype(np.float64)
        assert not np.isnan(got).any(), name
        np.testing.assert_allclose(got, want, rtol=tol, atol=atol if atol is not None else tol, err_msg=name)

    close(biased_glu.moe_biased_glu(hd, bd, od, ALPHA, LIMIT), R.biased_glu(h, bias, off, ALPHA, LIMIT), "z",
          atol=tol * 8)
    dh, dbias = biased_glu.moe_biased_glu_backward(dzd, hd, bd, od, ALPHA, LIMIT)
    want_dh, _ = R.biased_glu_backward(dz, h, bias, off, ALPHA, LIMIT)
    close(dh, want_dh, "dh", atol=tol * 8)
    # (the bias's gradient sums dh as the kernel rounded it)
    assert "float32" in str(dbias.dtype)
    np.testing.assert_allclose(to_host(dbias), R.group_sums(to_host(dh), off, experts), rtol=1e-5, atol=1e-4)
    for e in np.flatnonzero(np.asarray(counts) == 0):
        assert not to_host(dbias)[e].any()
    again = biased_glu.moe_biased_glu_backward(dzd, hd, bd, od, ALPHA, LIMIT)
    np.testing.assert_array_equal(to_host(again[1]), to_host(dbias))
    yd = to_device(y, framework)
    close(biased_glu.moe_group_bias(yd, to_device(bias, framework), od), R.group_bias(y, bias, off), "y + bias")
    sums = to_host(biased_glu.moe_group_sums(yd, od, experts))
    np.testing.assert_allclose(sums, R.group_sums(y, off, experts), rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(to_host(biased_glu.moe_group_sums(yd, od, experts)), sums)
