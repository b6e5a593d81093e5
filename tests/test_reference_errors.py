"""What a new user meets first, on a CPU: the references' errors (None for an array, head dims
the kernels refuse) and results (NaN, warnings), check_errors() and the benchmark without CuPy,
patch()'s min_size, and the skip summary of a run without a GPU."""
from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import cukern
from cukern import _bench, _faults, reference as ref
from conftest import DryRun

from arrays import torch

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")


def _h(*shape, dtype=np.float16, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


# Valid arguments of every reference (and of its kernel front: the same signature), float16.
_q, _kv, _p, _cu = _h(1, 4, 2, 64), _h(1, 4, 2, 64, seed=1), _h(6, 2, 64), np.array([0, 2, 6], np.int32)
_x, _w, _s = _h(3, 8), _h(8), np.ones(3, np.float32)
_xg, _wg, _sg = _h(2, 4, 3), _h(4), np.ones((2, 2), np.float32)
_lg, _t = _h(4, 10), np.array([1, 2, 3, 0])
_rq, _rk, _cs = _h(1, 2, 4, 8), _h(1, 1, 4, 8), _h(4, 8)
CASES = {
    "attention": ((_q, _kv, _kv), {}),
    "attention_backward": ((_q, _q, _kv, _kv, _q, np.zeros((1, 2, 4), np.float32)), {}),
    "attention_varlen": ((_p, _p, _p, _cu, _cu, 4, 4), {}),
    "attention_varlen_backward": ((_p, _p, _p, _p, _p, np.zeros((2, 6), np.float32), _cu, _cu, 4, 4), {}),
    "cross_entropy": ((_lg, _t), {}),
    "cross_entropy_backward": ((np.ones((), np.float16), _lg, _t, np.zeros(4, np.float32)), {}),
    "cross_entropy_forward_backward": ((_lg, _t), {}),
    "linear_cross_entropy": ((_h(4, 8), _h(10, 8), _t, _h(10)), {}),
    "linear_cross_entropy_forward_backward": ((_h(4, 8), _h(10, 8), _t, _h(10)), {}),
    "embedding": ((np.array([0, 2, 1]), _h(5, 8)), {}),
    "embedding_backward": ((_h(3, 8), np.array([0, 2, 1]), 5), {}),
    "swiglu": ((_x, _x), {}), "swiglu_backward": ((_x, _x, _x), {}),
    "geglu": ((_x, _x), {}), "geglu_backward": ((_x, _x, _x), {}),
    "layer_norm": ((_x, _w, _w), {"residual": _x}),
    "layer_norm_backward": ((_x, _x, _w, _s, _s), {"dresidual": _x}),
    "rms_norm": ((_x, _w), {"residual": _x}),
    "rms_norm_backward": ((_x, _x, _w, _s), {"dresidual": _x}),
    "group_norm": ((_xg, 2, _wg, _wg), {}),
    "group_norm_backward": ((_xg, _xg, 2, _wg, _sg, _sg), {}),
    "rope": ((_rq, _rk, _cs, _cs), {}), "rope_backward": ((_rq, _rk, _cs, _cs), {}),
}
# (the references recompute out and lse, so they take None for them where the kernels need them)
RECOMPUTED = {("attention_backward", "out"), ("attention_backward", "lse"),
              ("attention_varlen_backward", "out"), ("attention_varlen_backward", "lse")}


def _array_arguments():
    for name, (args, kwargs) in CASES.items():   # (test_every_reference_has_a_case: all of them)
        bound = inspect.signature(getattr(ref, name)).bind(*args, **kwargs)
        for arg, value in bound.arguments.items():
            if isinstance(value, np.ndarray):
                yield pytest.param(name, arg, id=f"{name}-{arg}")


def _with_none(f, name, arg):
    args, kwargs = CASES[name]
    bound = inspect.signature(f).bind(*args, **kwargs)
    bound.arguments[arg] = None
    return lambda: f(*bound.args, **bound.kwargs)


@pytest.fixture
def dry(host_arrays_as_device, monkeypatch):
    """The kernel fronts on NumPy arrays up to their launch (and a host fault record)."""
    monkeypatch.setattr(_faults, "record", lambda device: np.zeros(3, np.int64))


def _outcome(call):
    """None when the call runs (a front: reaches its launch), else (type, message)."""
    try:
        call()
    except DryRun:
        return None
    except Exception as e:  # noqa: BLE001 - compared below
        return type(e), str(e)
    return None


# ---- 1. None for an array ----------------------------------------------------------------------

def test_every_reference_has_a_case():
    assert sorted(CASES) == ref.__all__


@pytest.mark.parametrize("name, arg", list(_array_arguments()))
def test_none_for_an_array_gets_the_kernels_answer(name, arg, dry):
    """Every array argument of every reference, given None: the error of the kernel front (the
    same type and message, naming the argument), or a result where the front takes None too."""
    front = _outcome(_with_none(getattr(cukern, name), name, arg))
    got = _outcome(_with_none(getattr(ref, name), name, arg))
    if front is None or (name, arg) in RECOMPUTED:
        assert got is None, f"{name}({arg}=None): {got}"
    else:
        assert front[1].startswith(f"{arg}:"), front
        assert got == front


@needs_torch
def test_flash_attn_func_names_a_missing_q():
    import cukern.torch as ct

    with pytest.raises(TypeError, match="^q: required, got None"):
        ct.flash_attn_func(None, None, None)


# ---- 2. head dims the kernels refuse -----------------------------------------------------------

@pytest.mark.parametrize("d", [7, 512])
def test_the_references_refuse_the_head_dims_the_kernels_refuse(d, dry):
    q, lse = _h(1, 4, 2, d), np.zeros((1, 2, 4), np.float32)
    p, lse_p = _h(6, 2, d), np.zeros((2, 6), np.float32)
    for name, args in [("attention", (q, q, q)), ("attention_backward", (q, q, q, q, q, lse)),
                       ("attention_varlen", (p, p, p, _cu, _cu, 4, 4)),
                       ("attention_varlen_backward", (p, p, p, p, p, lse_p, _cu, _cu, 4, 4))]:
        front = _outcome(lambda: getattr(cukern, name)(*args))
        assert front is not None and front[1].startswith(f"q: head_dim {d} is not supported"), front
        assert _outcome(lambda: getattr(ref, name)(*args)) == front, name


# ---- 3. NaN ------------------------------------------------------------------------------------

def test_attention_reference_propagates_nan_as_softmax_does():
    """A NaN in q: its row's out and lse are NaN (as torch.softmax gives there), the
    other rows are unchanged; a NaN in k: every query that sees that key. Rows that see no key
    keep zeros and lse = +inf."""
    q, k, v = (_h(*s, dtype=np.float64, seed=i) for i, s in enumerate([(1, 5, 2, 32), (1, 5, 1, 32), (1, 5, 1, 32)]))
    base = ref.attention(q, k, v)
    qn = q.copy()
    qn[0, 3, 1, 5] = np.nan
    out, lse = ref.attention(qn, k, v, return_lse=True)
    assert np.isnan(out[0, 3, 1]).all() and np.isnan(lse[0, 1, 3])
    rows = np.ones(out.shape, bool)
    rows[0, 3, 1] = False
    np.testing.assert_array_equal(out[rows], base[rows])
    assert np.isnan(ref.attention_backward(np.ones_like(q), qn, k, v)[0][0, 3, 1]).all()
    kn = k.copy()
    kn[0, 1, 0, 0] = np.nan
    out, lse = ref.attention(q, kn, v, causal=True, return_lse=True)   # (query i sees keys 0 to i)
    assert np.isnan(out[0, 1:]).all() and np.isnan(lse[..., 1:]).all()
    assert np.isfinite(out[0, 0]).all() and np.isfinite(lse[..., 0]).all()
    out, lse = ref.attention(q, kn[:, :2], v[:, :2], causal=True, return_lse=True)   # (queries 0-2 see no key)
    assert (out[0, :3] == 0).all() and (lse[..., :3] == np.inf).all()
    assert np.isfinite(out[0, 3]).all() and np.isnan(out[0, 4]).all()
    if torch is not None:   # (softmax's own NaN rows; SDPA's CPU kernels differ by version: 2.11 gave finite rows)
        tq, tk, tv = (torch.tensor(a).transpose(1, 2) for a in (qn, np.repeat(k, 2, 2), np.repeat(v, 2, 2)))
        t = torch.softmax(tq @ tk.transpose(-1, -2) / np.sqrt(q.shape[-1]), dim=-1) @ tv
        np.testing.assert_array_equal(np.isnan(t.transpose(1, 2).numpy()), np.isnan(ref.attention(qn, k, v)))


# ---- 4. the forward reference's outputs feed the backward one ----------------------------------

def test_attention_backward_takes_the_forward_references_outputs():
    q, k, v, dout = _h(1, 6, 2, 32), _h(1, 6, 1, 32, seed=1), _h(1, 6, 1, 32, seed=2), _h(1, 6, 2, 32, seed=3)
    out, lse = ref.attention(q, k, v, causal=True, return_lse=True)   # (float64)
    expect = ref.attention_backward(dout, q, k, v, causal=True)
    for do in (dout, dout.astype(np.float64)):
        for got, e in zip(ref.attention_backward(do, q, k, v, out, lse, causal=True), expect):
            np.testing.assert_array_equal(got, e)


def test_attention_varlen_backward_takes_the_forward_references_outputs():
    q, k, v, dout = _h(6, 2, 32), _h(6, 1, 32, seed=1), _h(6, 1, 32, seed=2), _h(6, 2, 32, seed=3)
    out, lse = ref.attention_varlen(q, k, v, _cu, _cu, 4, 4, return_lse=True)
    expect = ref.attention_varlen_backward(dout, q, k, v, None, None, _cu, _cu, 4, 4)
    for got, e in zip(ref.attention_varlen_backward(dout, q, k, v, out, lse, _cu, _cu, 4, 4), expect):
        np.testing.assert_array_equal(got, e)


# ---- 5, 7. without CuPy ------------------------------------------------------------------------

def test_check_errors_without_cupy_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)   # (import cupy raises ImportError)
    with pytest.raises(ImportError, match=r'^check_errors: needs CuPy.*"cukern\[cuda13\]".*\[ctk\]'):
        cukern.check_errors()


def test_the_benchmark_without_cupy_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)
    reason = _bench.unavailable_reason()
    assert 'CuPy is not installed' in reason and '"cukern[cuda13]"' in reason and "[ctk]" in reason


# ---- 6. patch(min_size=...) --------------------------------------------------------------------

@needs_torch
@pytest.mark.parametrize("min_size, exc, pattern", [
    (-1, ValueError, "^min_size: must be >= 0, got -1"),
    (1.5, TypeError, "^min_size: expected an int, got float"),
    (True, TypeError, "^min_size: expected an int, got bool"),
    ("8", TypeError, "^min_size: expected an int, got str"),
    ({"layer_norm": -3}, ValueError, r"^min_size\['layer_norm'\]: must be >= 0, got -3"),
    ({"layer_norm": 2.0}, TypeError, r"^min_size\['layer_norm'\]: expected an int, got float"),
    ({"layernorm": 0}, ValueError, r"^min_size: unknown \['layernorm'\]; choose from"),
])
def test_patch_refuses_a_bad_min_size_and_patches_nothing(min_size, exc, pattern):
    import cukern.torch as ct
    from cukern.torch import _tools

    before = dict(_tools.MIN_SIZE)
    model = torch.nn.Sequential(torch.nn.LayerNorm(8))
    for target in (None, model):
        with pytest.raises(exc, match=pattern):
            ct.patch(target, min_size=min_size)
        assert not ct.is_patched(target) and _tools.MIN_SIZE == before


@needs_torch
def test_patch_takes_numpy_ints_for_min_size():
    import cukern.torch as ct
    from cukern.torch import _tools

    with ct.patch(min_size=np.int64(0)):
        assert set(_tools.MIN_SIZE.values()) == {0}


# ---- 8. the skip summary of a run without a GPU ------------------------------------------------

def test_gpu_skips_fold_into_one_summary_line(tmp_path):
    """With no GPU, the `gpu` tests' skips are one line of `-ra` (counted, with the reason); other
    skips keep their own lines, and failures still fail."""
    conftest = Path(__file__).with_name("conftest.py").read_text()
    (tmp_path / "conftest.py").write_text(conftest + "\n\ndef gpu_unavailable_reason():\n"
                                          "    return 'no CUDA device (simulated)'\n")
    (tmp_path / "fakes.py").write_text(Path(__file__).with_name("fakes.py").read_text())   # (conftest's import)
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    gpu: needs a CUDA device\n")
    (tmp_path / "test_x.py").write_text(
        "import pytest\n\n"
        "@pytest.mark.gpu\n@pytest.mark.parametrize('i', range(3))\ndef test_gpu(i): pass\n\n"
        "@pytest.mark.gpu\n@pytest.mark.skipif(True, reason='needs a CUDA build of torch')\ndef test_both(): pass\n\n"
        "@pytest.mark.skipif(True, reason='torch is not installed')\ndef test_other(): pass\n\n"
        "def test_cpu(): pass\n\ndef test_fails(): assert False\n")
    # (no plugins from entry points: the conftest's hooks are what is checked, and the assertion
    # rewriting of hypothesis' whole package, as a plugin's, costs a second where no byte code is cached)
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-ra", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("SKIPPED")]
    assert len(lines) == 2, r.stdout
    assert lines[0].startswith("SKIPPED [4] conftest.py:")
    assert lines[0].endswith("needs a GPU: no CUDA device (simulated)")
    assert lines[1].startswith("SKIPPED [1] test_x.py:") and lines[1].endswith("torch is not installed")
    assert r.stdout.rstrip().splitlines()[-1].startswith("1 failed, 1 passed, 5 skipped in"), r.stdout
    assert r.returncode == 1


# ---- 9. no RuntimeWarnings from the IEEE results -----------------------------------------------

_inf = np.array([[np.inf, 1, 2, 3]], np.float32)
_c = np.ones((2, 4), np.float32)
_g = np.array([[-1000, 1000, np.inf, -np.inf, np.nan, 0, 1, 2]], np.float32)
_r = np.ones((1, 1, 4, 8), np.float32)
_r[0, 0, 0, 0] = np.inf
_z = np.zeros((4, 8), np.float32)


@pytest.mark.filterwarnings("error")
@pytest.mark.parametrize("call", [
    pytest.param(lambda: ref.layer_norm(_inf), id="layer_norm inf - inf"),
    pytest.param(lambda: ref.layer_norm(_c, eps=0), id="layer_norm 1 / sqrt(0)"),
    pytest.param(lambda: ref.layer_norm(np.array([[1e300, -1e300, 0, 1]])), id="layer_norm variance overflows"),
    pytest.param(lambda: ref.layer_norm(_inf, out_dtype="float8_e4m3fn", scale=np.ones(1, np.float32)),
                 id="layer_norm fp8 of NaN"),
    pytest.param(lambda: ref.rms_norm(_inf), id="rms_norm inf * 0"),
    pytest.param(lambda: ref.rms_norm(np.zeros((1, 4), np.float32), eps=0), id="rms_norm 1 / sqrt(0)"),
    pytest.param(lambda: ref.layer_norm_backward(_c, _c, None, np.ones(2, np.float32), np.full(2, np.inf, np.float32)),
                 id="layer_norm_backward inf rstd"),
    pytest.param(lambda: ref.group_norm(np.array([[[np.inf, 1], [2, 3]]], np.float32), 1), id="group_norm inf - inf"),
    pytest.param(lambda: ref.group_norm(np.ones((1, 2, 2), np.float32), 1, eps=0), id="group_norm 1 / sqrt(0)"),
    pytest.param(lambda: ref.swiglu(_g, _g), id="swiglu exp overflows"),
    pytest.param(lambda: ref.swiglu_backward(_g, _g, _g), id="swiglu_backward exp overflows"),
    pytest.param(lambda: ref.geglu(_g, _g, "tanh"), id="geglu inf * 0"),
    pytest.param(lambda: ref.geglu_backward(_g, _g, _g), id="geglu_backward inf * 0"),
    pytest.param(lambda: ref.rope(_r, None, _z, _z), id="rope inf * 0"),
    pytest.param(lambda: ref.rope(np.full((1, 1, 4, 8), 6e4, np.float16), None, np.ones((4, 8), np.float16),
                                  np.ones((4, 8), np.float16)), id="rope float16 rounding overflows"),
    pytest.param(lambda: ref.cross_entropy_forward_backward(np.ones((1, 2), np.float32), np.array([-100])),
                 id="cross_entropy no kept row"),
])
def test_references_give_ieee_results_without_warnings(call):
    call()
