"""Cross-entropy: the references against PyTorch in float64 (CPU), argument checking and the
launch plans (CPU), and the kernels against the references and PyTorch (GPU): every option,
every dtype, odd and large vocabularies, ignored rows, extreme logits, strided rows, the
in-place training form, out-of-range targets and the drop-in under autograd."""
from __future__ import annotations

import importlib

import numpy as np
import pytest
from conftest import DryRun
from hypothesis import HealthCheck, given, settings, strategies as st

import cukern
from cukern import reference as ref

from arrays import FLOAT_DTYPES, assert_close, poison_allocator, random_host, to_device, to_host, torch

ce = importlib.import_module("cukern.cross_entropy")
gpu = pytest.mark.gpu
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")
FRAMEWORKS = ["cupy", "torch"] if torch is not None else ["cupy"]
# loss tolerance by logits dtype (float32 arithmetic, the loss rounded to the dtype);
# gradients are measured against the row's scale (they are probabilities, mostly tiny)
LOSS_TOL = {"float32": 2e-5, "float16": 2e-3, "bfloat16": 1e-2}
GRAD_TOL = {"float32": 1e-4, "float16": 3e-3, "bfloat16": 2e-2}


def _targets(rng, rows: int, v: int, ignore: float = 0.2, dtype="int64", ignore_index=-100):
    t = rng.integers(0, v, size=rows)
    t[rng.random(rows) < ignore] = ignore_index
    return t.astype(dtype)


# ---- the references against PyTorch (CPU, float64) ---------------------------------------------

def _torch_loss(x, t, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None, reduction="mean"):
    """The loss the options describe, written with PyTorch's float64 ops (autograd gives the
    gradient): cross_entropy of the softcapped logits plus z_loss * lse^2 a kept row."""
    F = torch.nn.functional
    z = softcap * torch.tanh(x / softcap) if softcap else x
    loss = F.cross_entropy(z, t, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction=reduction)
    if z_loss:
        keep = (t != ignore_index).double()
        zl = z_loss * torch.logsumexp(z, dim=-1) ** 2 * keep
        loss = loss + {"none": zl, "sum": zl.sum(), "mean": zl.sum() / keep.sum()}[reduction]
    return loss


@needs_torch
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("opts", [{}, {"label_smoothing": 0.1}, {"z_loss": 1e-3}, {"softcap": 5.0},
                                  {"label_smoothing": 0.2, "z_loss": 1e-2, "softcap": 3.0, "ignore_index": 3}])
def test_reference_matches_pytorch_in_float64(reduction, opts):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((37, 29)) * 3
    t = _targets(rng, 37, 29, ignore_index=opts.get("ignore_index", -100))
    loss, lse = ref.cross_entropy(x, t, reduction=reduction, return_lse=True, **opts)
    xt = torch.tensor(x, requires_grad=True)
    expect = _torch_loss(xt, torch.tensor(t), reduction=reduction, **opts)
    np.testing.assert_allclose(loss, expect.detach().numpy(), rtol=1e-12, atol=1e-12)
    dloss = np.asarray(rng.standard_normal(expect.shape) + 2.0)
    (gx,) = torch.autograd.grad(expect, xt, torch.tensor(dloss))
    got = ref.cross_entropy_backward(dloss, x, t, lse.astype(np.float32), reduction=reduction, **opts)
    np.testing.assert_allclose(got, gx.numpy(), rtol=1e-10, atol=1e-12)


def test_reference_training_form_is_the_forward_and_backward_with_an_upstream_one():
    rng = np.random.default_rng(1)
    x = random_host(rng, (6, 11), "float32")
    t = _targets(rng, 6, 11)
    loss, d = ref.cross_entropy_forward_backward(x, t, label_smoothing=0.1)
    assert loss == ref.cross_entropy(x, t, label_smoothing=0.1)
    lse = ref.cross_entropy(x, t, return_lse=True)[1].astype(np.float32)
    np.testing.assert_array_equal(d, ref.cross_entropy_backward(np.ones((), np.float32), x, t, lse,
                                                                   label_smoothing=0.1))


def test_reference_all_rows_ignored_gives_nan_mean_and_zero_gradient():
    x = np.ones((3, 4))
    t = np.full(3, -100)
    assert np.isnan(ref.cross_entropy(x, t))
    assert ref.cross_entropy(x, t, reduction="sum") == 0.0
    assert not ref.cross_entropy_backward(np.ones(()), x, t, np.zeros(3, np.float32), reduction="sum").any()


# ---- arguments and plans (CPU) ----------------------------------------------------------------------

X = np.ones((4, 8), np.float16)
T = np.array([0, 1, 2, 3])
BAD = [
    ((X, T.astype(np.float32)), {}, ValueError, "target: dtype float32 is not supported"),
    ((X, T[:3]), {}, ValueError, r"target: shape \(3,\) does not match the leading shape of logits, \(4,\)"),
    ((np.ones((4, 0), np.float16), T), {}, ValueError, "logits: the class axis"),
    ((np.array(1.0, np.float16), np.array(0)), {}, ValueError, "logits: must have at least one axis"),
    ((X, T), {"label_smoothing": 1.5}, ValueError, "label_smoothing: must be in"),
    ((X, T), {"label_smoothing": -0.1}, ValueError, "label_smoothing: must be finite and non-negative"),
    ((X, T), {"z_loss": float("inf")}, ValueError, "z_loss"),
    ((X, T), {"softcap": -1.0}, ValueError, "softcap: must be finite and non-negative"),
    ((X, T), {"softcap": 1e-45}, ValueError, "softcap: .* outside float32's normal range"),
    ((X, T), {"reduction": "avg"}, ValueError, "reduction: must be one of"),
    ((X, T), {"ignore_index": 1.0}, TypeError, "ignore_index: expected an int"),
    ((X, T), {"loss_dtype": "float64"}, ValueError, "loss_dtype: must be float32 or the logits' dtype"),
    ((X.astype(np.int32), T), {}, ValueError, "logits: dtype int32 is not supported"),
    (("x", T), {}, TypeError, "logits: expected"),
]


def test_softcap_none_and_zero_both_mean_none():
    """One convention everywhere (attention's too): None and 0 leave the logits as they are."""
    rng = np.random.default_rng(5)
    x, t = random_host(rng, (5, 12), "float32"), np.array([0, 3, 11, 2, 7])
    base = ref.cross_entropy_forward_backward(x, t, reduction="none")
    for cap in (None, 0.0, 0):
        got = ref.cross_entropy_forward_backward(x, t, reduction="none", softcap=cap)
        assert all(np.array_equal(a, b) for a, b in zip(got, base))
    assert ce._options(-100, 0.0, 0.0, 0.0, "mean") == ce._options(-100, 0.0, 0.0, None, "mean")
    w = random_host(rng, (12, 4), "float32")
    h = random_host(rng, (5, 4), "float32")
    assert ref.linear_cross_entropy(h, w, t, softcap=0.0) == ref.linear_cross_entropy(h, w, t, softcap=None)


@pytest.fixture
def dry(host_arrays_as_device, monkeypatch):
    """host_arrays_as_device, with a host fault record (the real one lives on a device)."""
    monkeypatch.setattr(ce._faults, "record", lambda device: np.zeros(3, np.int64))


@pytest.mark.parametrize("args, kw, exc, pattern", BAD)
def test_bad_arguments_get_the_same_message_from_front_and_reference(args, kw, exc, pattern, dry):
    with pytest.raises(exc, match=pattern):
        cukern.cross_entropy(*args, **kw)
    with pytest.raises(exc, match=pattern):
        ref.cross_entropy(*args, **kw)


def test_backward_checks_dloss_and_lse(dry):
    lse = np.zeros(4, np.float32)
    for args, kw, pattern in [
        ((np.ones(4, np.float16), X, T, lse), {}, r"dloss: shape \(4,\) does not match the loss's \(\)"),
        ((np.ones((), np.float16), X, T, lse), {"reduction": "none"}, "dloss: shape"),
        ((np.ones((), np.float64), X, T, lse), {}, "dloss: dtype float64"),
        ((np.ones((), np.float16), X, T, np.zeros(3, np.float32)), {}, "lse: must be float32 of shape"),
    ]:
        with pytest.raises(ValueError, match=pattern):
            cukern.cross_entropy_backward(*args, **kw)


def test_out_of_range_targets_raise_in_the_reference():
    with pytest.raises(IndexError, match="target: class 8 is out of range for 8 classes"):
        ref.cross_entropy(np.ones((2, 8)), np.array([8, 0]))
    ref.cross_entropy(np.ones((2, 8)), np.array([-100, 0]))   # ignore_index is not a fault


def _plan(call):
    with pytest.raises(DryRun) as info:
        call()
    return info.value.plan


def _launches(plan) -> dict:
    return {s[1].kernel_name: s[4] for s in plan.steps if isinstance(s, tuple)}


def test_plans_launch_what_each_form_needs_and_read_strided_rows_in_place(dry):
    x = np.ones((6, 64), np.float16)
    t = np.arange(6)
    fwd = _launches(_plan(lambda: cukern.cross_entropy(x, t)))
    assert set(fwd) == {"cross_entropy_count", "cross_entropy_rows", "cross_entropy_reduce"}
    assert fwd["cross_entropy_rows"]["dlogits"] == 0 and fwd["cross_entropy_rows"]["x_stride"] == 64
    assert set(_launches(_plan(lambda: cukern.cross_entropy(x, t, reduction="sum")))) == {
        "cross_entropy_rows", "cross_entropy_reduce"}
    none = _plan(lambda: cukern.cross_entropy(x, t, reduction="none", loss_dtype="float32"))
    assert set(_launches(none)) == {"cross_entropy_rows"}   # the per-row losses are the output
    assert "cross_entropy_cast" in _launches(_plan(lambda: cukern.cross_entropy(x, t, reduction="none")))
    wide = np.ones((6, 96), np.float16)[:, :64]
    plan = _plan(lambda: cukern.cross_entropy_forward_backward(wide, t, inplace=True))
    assert plan.fixes == ()
    rows = _launches(plan)["cross_entropy_rows"]
    assert rows["x_stride"] == 96 and rows["d_stride"] == 96
    plan = _plan(lambda: cukern.cross_entropy_forward_backward(wide, t))
    assert _launches(plan)["cross_entropy_rows"]["d_stride"] == 64
    plan = _plan(lambda: cukern.cross_entropy(np.ones((64, 6), np.float16).T, t))   # classes strided: a copy
    assert [slot for slot, _ in plan.fixes] == [0]
    with pytest.raises(ValueError, match="logits: inplace needs rows with a unit-stride class axis"):
        cukern.cross_entropy_forward_backward(np.ones((64, 6), np.float16).T, t, inplace=True)


def test_the_training_form_splits_wide_rows_over_a_cluster_on_sm90(dry, monkeypatch):
    from cukern import _kernels

    def kernels(v, cc, dtype=np.float16, rows=6):
        monkeypatch.setattr(_kernels, "compute_capability", lambda device: cc)
        ce._PLANS.clear()
        plan = _plan(lambda: cukern.cross_entropy_forward_backward(np.ones((rows, v), dtype), np.arange(rows)))
        return {s[1].name: s[2] for s in plan.steps
                if isinstance(s, tuple) and s[1].kernel_name in ("cross_entropy_rows", "cross_entropy_train_cluster")}

    # the shipped configuration: the smallest cluster of 256-thread CTAs (staged in shared memory)
    # that holds the row in 8 vectors a thread: 8 CTAs for LLaMA-3's vocabulary, 4 for GPT-2's
    # padded 50304 and for 65536, 2 for Mistral's 32000 and down to cluster_min
    got = kernels(128256, (9, 0))
    assert list(got) == ["cross_entropy_train_cluster<cuk::half, long long, 8, 256, 8, 8, 1>"]
    assert list(got.values()) == [6 * 8]                                  # a cluster of 8 a row
    assert list(kernels(50304, (9, 0))) == ["cross_entropy_train_cluster<cuk::half, long long, 8, 256, 8, 4, 1>"]
    assert list(kernels(65536, (9, 0))) == ["cross_entropy_train_cluster<cuk::half, long long, 8, 256, 8, 4, 1>"]
    got = kernels(32000, (9, 0))
    assert list(got) == ["cross_entropy_train_cluster<cuk::half, long long, 8, 256, 8, 2, 1>"]
    assert list(got.values()) == [6 * 2]
    assert list(kernels(8192, (9, 0))) == ["cross_entropy_train_cluster<cuk::half, long long, 8, 256, 2, 2, 1>"]
    assert "train_cluster" not in str(kernels(8184, (9, 0)))             # below cluster_min: two passes
    assert "train_cluster" not in str(kernels(128256, (8, 0)))           # A100: two passes
    assert "train_cluster" not in str(kernels(128255, (9, 0)))           # odd V: scalar loads, two passes
    assert "train_cluster" not in str(kernels(151936, (9, 0)))           # too wide for the part
    # the number of vectors a thread follows the width
    assert list(kernels(12000, (9, 0))) == ["cross_entropy_train_cluster<cuk::half, long long, 8, 256, 4, 2, 1>"]
    assert "train_cluster" not in str(kernels(4096, (9, 0)))             # narrow rows: two passes
    assert ", 256, 8, 8, 1>" in str(kernels(2**16, (9, 0), np.float32))        # float32: 8 vectors of 256 threads
    assert "train_cluster" not in str(kernels(2**17, (9, 0), np.float32))  # too wide for the part
    # 128-thread CTAs hold their part in registers
    monkeypatch.setattr(ce.configs, "CONFIGS", ce.Configs(clusters=(8,), cluster_threads=(128, 256)))
    assert list(kernels(65536, (9, 0))) == ["cross_entropy_train_cluster<cuk::half, long long, 8, 128, 8, 8, 0>"]
    # a grid of at most max_clusters clusters (the kernel loops over the rest)
    monkeypatch.setattr(ce.configs, "CONFIGS", ce.Configs(max_clusters=2))
    assert list(kernels(128256, (9, 0), rows=5).values()) == [2 * 8]
    monkeypatch.setattr(ce.configs, "CONFIGS", ce.Configs(use_cluster=False))
    assert "train_cluster" not in str(kernels(128256, (9, 0)))
    # clusters of 16 (beyond the portable size: the instance says so, and loading allows it)
    monkeypatch.setattr(ce.configs, "CONFIGS", ce.Configs(clusters=(16,), cluster_threads=(128, 256)))
    got = kernels(128256, (9, 0))
    assert list(got) == ["cross_entropy_train_cluster<cuk::half, long long, 8, 128, 8, 16, 0>"]
    assert list(got.values()) == [6 * 16]
    assert ce.configs.CONFIGS.train_cluster("float16", "int64", 16, 128, 8).cluster == 16
    ce._PLANS.clear()


def test_odd_vocabularies_and_misaligned_rows_take_scalar_loads(dry):
    def instance(x):
        plan = _plan(lambda: cukern.cross_entropy(x, np.arange(x.shape[0])))
        return next(s[1].name for s in plan.steps if isinstance(s, tuple) and "rows" in s[1].name)

    assert ", 8, 512, 0, float>" in instance(np.ones((3, 64), np.float16))
    assert ", 1, 512, 0, float>" in instance(np.ones((3, 63), np.float16))
    assert ", 1, 512, 0, float>" in instance(np.ones((3, 65), np.float16)[:, 1:])
    assert ", 4, 512, 0, float>" in instance(np.ones((3, 64), np.float32))


def _indices(host: np.ndarray, framework: str):
    """Integer targets on the device, their dtype kept (to_device is for floats)."""
    if framework == "torch":
        return torch.from_numpy(np.ascontiguousarray(host)).cuda()
    import cupy

    return cupy.asarray(host)


# ---- the kernels (GPU) ---------------------------------------------------------------------------------

def _check(framework, dtype, rows, v, *, seed=0, scale=3.0, strided=False, ignore=0.2, index="int64",
           exact_forward=True, **opts):
    """Forward (loss, lse), training form (copy and in place) and backward against the
    reference, each output poisoned first. The training form's loss is the forward's bit for bit
    when both run the same reduction (``exact_forward``; the sm_90 cluster kernels reduce a row
    in another order: within float32 rounding), and reproducible bit for bit in any case."""
    rng = np.random.default_rng(seed)
    xh = random_host(rng, (rows, v + (5 if strided else 0)), dtype, scale)
    th = _targets(rng, rows, v, ignore, index, opts.get("ignore_index", -100))
    xd = to_device(xh, framework)
    if strided:
        xd, xh = xd[:, 2:v + 2], xh[:, 2:v + 2]
    td = _indices(th, framework)
    red = opts.get("reduction", "mean")
    poison_allocator(framework, [rows * v * 4, rows * 4, 4])
    loss, lse = cukern.cross_entropy(xd, td, return_lse=True, **opts)
    rloss, rlse = ref.cross_entropy(xh, th, return_lse=True, **opts)
    if red == "mean" and not (th != opts.get("ignore_index", -100)).any():   # every row ignored
        loss, d = cukern.cross_entropy_forward_backward(xd, td, **opts)
        assert np.isnan(to_host(loss)) and not to_host(d).any()
        return
    assert_close(lse, rlse, "float32", "lse", tol=2e-6, scale=1.0)
    assert_close(loss, rloss, dtype, "loss", tol=LOSS_TOL[dtype], scale=1.0)
    l2, d = cukern.cross_entropy_forward_backward(xd, td, **opts)
    if exact_forward:
        assert to_host(l2).tobytes() == to_host(loss).tobytes()
    else:
        ulp = {"float32": 1e-6, "float16": 2**-10, "bfloat16": 2**-7}[dtype]   # (at most an ulp of the loss)
        np.testing.assert_allclose(to_host(l2).astype(np.float64), to_host(loss).astype(np.float64), rtol=ulp)
    l3, d3 = cukern.cross_entropy_forward_backward(xd, td, **opts)
    assert to_host(l3).tobytes() == to_host(l2).tobytes() and to_host(d3).tobytes() == to_host(d).tobytes()
    dloss_h = random_host(rng, np.shape(rloss) or (1,), dtype, 1.0, 2.0).reshape(np.shape(rloss))
    rd1 = ref.cross_entropy_backward(np.ones(np.shape(rloss)), xh, th, rlse.astype(np.float32), **opts)
    scale_g = 1.0 / max(rows, 1) if red == "mean" else 1.0
    assert_close(d, rd1, dtype, "dlogits (training form)", tol=GRAD_TOL[dtype], scale=scale_g / v)
    dd = cukern.cross_entropy_backward(to_device(dloss_h, framework), xd, td, lse, **opts)
    rd = ref.cross_entropy_backward(dloss_h, xh, th, rlse.astype(np.float32), **opts)
    assert_close(dd, rd, dtype, "dlogits (backward)", tol=GRAD_TOL[dtype], scale=3 * scale_g / v)
    xd2 = to_device(xh, framework) if strided else xd
    _, d_in = cukern.cross_entropy_forward_backward(xd2, td, inplace=True, **opts)
    assert d_in is xd2 and to_host(d_in).tobytes() == to_host(d).tobytes()
    cukern.check_errors()


@gpu
@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("v", [1, 2, 7, 64, 1000, 4099, 8192, 32000, 50000, 2**17, 2**17 + 1])
def test_kernels_match_the_reference(framework, dtype, v):
    """(On sm_90 the training form of vocabularies from cluster_min up whose rows take 16-byte
    vectors runs on a cluster a row.)"""
    rows = 3 if v > 40000 else 9
    _check(framework, dtype, rows, v, seed=v, exact_forward=v < ce.configs.CONFIGS.cluster_min)


@gpu
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 20), v=st.integers(1, 3000), dtype=st.sampled_from(FLOAT_DTYPES),
       reduction=st.sampled_from(["mean", "sum", "none"]), smoothing=st.sampled_from([0.0, 0.1, 1.0]),
       z_loss=st.sampled_from([0.0, 1e-4, 0.1]), softcap=st.sampled_from([None, 2.0, 30.0]),
       strided=st.booleans(), index=st.sampled_from(["int32", "int64"]), ignore=st.sampled_from([0.0, 0.3, 1.0]),
       seed=st.integers(0, 2**16))
def test_every_option_matches_the_reference(rows, v, dtype, reduction, smoothing, z_loss, softcap, strided, index,
                                            ignore, seed):
    if ignore == 1.0 and reduction == "mean":
        return   # NaN by definition: test_all_rows_ignored
    _check(FRAMEWORKS[seed % len(FRAMEWORKS)], dtype, rows, v, seed=seed, strided=strided, ignore=ignore,
           index=index, reduction=reduction, label_smoothing=smoothing, z_loss=z_loss, softcap=softcap)


@gpu
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("v, opts", [(8192, {}), (50000, {"label_smoothing": 0.1, "z_loss": 1e-3}),
                                     (128256, {"softcap": 30.0, "reduction": "none"}), (2**17, {"reduction": "sum"})])
@pytest.mark.parametrize("kind", ["2 x 256 threads", "4 x 256 threads", "8 x 128 threads", "8 x 256 threads",
                                  "8 x 256 threads looping", "8 x 256 threads in registers", "16 x 128 threads",
                                  "16 x 128 threads looping"])
def test_the_cluster_training_form_matches_the_reference(dtype, v, opts, kind, monkeypatch):
    """The sm_90 path (a row over a cluster of 2 to 16 CTAs of 128 or 256 threads, the part in
    shared memory or in registers; a cluster a row, or two clusters looping over the rows), copy
    and in place, against the reference."""
    from cukern import _kernels

    if _kernels.compute_capability(0) < (9, 0):
        pytest.skip("clusters need sm_90")
    cluster, threads = (int(kind.split()[0]),), (int(kind.split()[2]),)
    if ce.Configs(clusters=cluster, cluster_threads=threads).cluster_vectors(
            v, 16 // (4 if dtype == "float32" else 2)) is None:
        pytest.skip(f"{v} classes are too wide for clusters of {kind}")
    configs = ce.Configs(cluster_min=8192, clusters=cluster, cluster_threads=threads,   # (down to 8192 classes)
                         max_clusters=2 if "looping" in kind else 1 << 27,
                         cluster_stage=() if "registers" in kind else (256,))
    monkeypatch.setattr(ce.configs, "CONFIGS", configs)
    ce._PLANS.clear()
    try:
        _check("torch" if torch is not None else "cupy", dtype, 5, v, seed=v, exact_forward=False, **opts)
    finally:
        ce._PLANS.clear()


@gpu
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_extreme_logits_do_not_overflow_and_minus_inf_is_allowed(framework):
    rng = np.random.default_rng(3)
    xh = random_host(rng, (6, 300), "float32", 1e4)
    xh[1, ::2] = -np.inf
    xh[2, :] = -1e4
    th = np.array([0, 1, 5, -100, 7, 299])
    loss, d = cukern.cross_entropy_forward_backward(to_device(xh, framework), _indices(th, framework))
    assert_close(loss, ref.cross_entropy(xh, th), "float32", "loss", tol=1e-5)
    assert_close(d, ref.cross_entropy_forward_backward(xh, th)[1], "float32", "dlogits", tol=1e-4, scale=0.2)


@gpu
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_all_rows_ignored_and_no_rows(framework):
    x = to_device(random_host(np.random.default_rng(4), (3, 50), "bfloat16"), framework)
    t = _indices(np.full(3, -100), framework)
    assert np.isnan(to_host(cukern.cross_entropy(x, t)))
    loss, d = cukern.cross_entropy_forward_backward(x, t, reduction="sum")
    assert to_host(loss) == 0 and not to_host(d).any()
    empty = to_device(np.ones((0, 50), np.float32), framework)
    e = _indices(np.zeros(0, np.int64), framework)
    assert np.isnan(to_host(cukern.cross_entropy(empty, e)))
    assert to_host(cukern.cross_entropy(empty, e, reduction="sum")) == 0
    assert to_host(cukern.cross_entropy(empty, e, reduction="none")).shape == (0,)


@gpu
@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_out_of_range_targets_are_recorded_and_their_rows_ignored(framework):
    rng = np.random.default_rng(5)
    xh = random_host(rng, (4, 40), "float32")
    th = np.array([3, 40, -1, 7])
    loss = cukern.cross_entropy(to_device(xh, framework), _indices(th, framework), reduction="none")
    with pytest.raises(IndexError, match=r"target: class (40|-1) is out of range for 40 classes"):
        cukern.check_errors()
    cukern.check_errors()   # cleared
    keep = np.array([3, -100, -100, 7])
    assert_close(loss, ref.cross_entropy(xh, keep, reduction="none"), "float32", "loss")


@gpu
@needs_torch
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16] if torch is not None else [])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_matches_pytorch_and_the_drop_in_under_autograd(dtype, reduction):
    import cukern.torch as ct
    from cukern.torch import _tools

    g = torch.Generator(device="cuda").manual_seed(0)
    x = (torch.randn(33, 1001, device="cuda", generator=g) * 3).to(dtype).requires_grad_(True)
    t = torch.randint(0, 1001, (33,), device="cuda", generator=g)
    t[::5] = -100
    old = _tools.MIN_SIZE.get("cross_entropy")
    _tools.MIN_SIZE["cross_entropy"] = 0
    try:
        for smoothing in (0.0, 0.1):
            ct.reset_counts()
            out = ct.cross_entropy(x, t, reduction=reduction, label_smoothing=smoothing)
            assert ct.counts()["cross_entropy"] == {"cukern": 1, "torch": 0}
            expect = torch.nn.functional.cross_entropy(x, t, reduction=reduction, label_smoothing=smoothing)
            assert out.dtype == expect.dtype and out.shape == expect.shape
            up = torch.rand(expect.shape, device="cuda", generator=g).to(dtype) + 0.5
            (gx,) = torch.autograd.grad(out, x, up)
            (ge,) = torch.autograd.grad(expect, x, up)
            tol = 2e-5 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(out.float(), expect.float(), rtol=tol, atol=tol)
            torch.testing.assert_close(gx.float(), ge.float(), rtol=tol, atol=tol * float(ge.abs().max()))
        with torch.autocast("cuda", dtype=torch.bfloat16):   # float32 loss, the bf16 logits read as they are
            out = ct.cross_entropy(x, t, reduction=reduction)
            expect = torch.nn.functional.cross_entropy(x, t, reduction=reduction)
        assert out.dtype == expect.dtype
        torch.testing.assert_close(out, expect, rtol=1e-2, atol=1e-2)
    finally:
        _tools.MIN_SIZE["cross_entropy"] = old


@gpu
@needs_torch
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16] if torch else [])
def test_backward_takes_the_unit_gradient_only_where_the_upstream_gradient_is_one(dtype):
    """The PyTorch binding's backward: rows whose upstream gradient is exactly 1 take the training
    form's gradient as it is (donated: not even read); the others are computed from the logits,
    as cross_entropy_backward computes them, so the upstream gradient is rounded into the result
    once; the kept gradient is written only where it is donated."""
    g = torch.Generator(device="cuda").manual_seed(3)
    x = (torch.randn(37, 1000, device="cuda", generator=g) * 3).to(dtype)
    t = torch.randint(0, 1000, (37,), device="cuda", generator=g)
    t[5] = -100
    opts = ce._options(-100, 0.1, 1e-3, None, "none")
    kw = dict(label_smoothing=0.1, z_loss=1e-3, reduction="none")
    loss, unit, lse = cukern.cross_entropy_forward_backward(x, t, return_lse=True, **kw)
    keep = unit.clone()
    up = torch.full((37,), 3.0, device="cuda", dtype=loss.dtype)
    up[::4] = 1.0
    got = ce._backward(up, x, t, lse, unit, opts, donate=False)
    assert torch.equal(unit, keep)
    expect = cukern.cross_entropy_backward(up, x, t, lse, **kw)
    ones = up == 1
    assert torch.equal(got[~ones], expect[~ones]) and torch.equal(got[ones], keep[ones])
    donated = ce._backward(up, x, t, lse, unit, opts, donate=True)
    assert donated.data_ptr() == unit.data_ptr() and torch.equal(donated, got)
    # a scalar upstream gradient of 1, donated: nothing changes
    _, unit, lse = cukern.cross_entropy_forward_backward(x, t, return_lse=True)
    keep = unit.clone()
    one = torch.ones((), device="cuda", dtype=dtype)
    out = ce._backward(one, x, t, lse, unit, ce._options(-100, 0.0, 0.0, None, "mean"), donate=True)
    assert out.data_ptr() == unit.data_ptr() and torch.equal(unit, keep)


def test_backward_refuses_a_unit_gradient_that_is_not_the_training_forms(host_arrays_as_device):
    rng = np.random.default_rng(0)
    x = random_host(rng, (4, 16), "float32")
    t = np.array([0, 1, 2, 3])
    lse = np.zeros(4, np.float32)
    opts, one = ce._options(-100, 0.0, 0.0, None, "mean"), np.array(1.0, np.float32)
    with pytest.raises(ValueError, match="unit"):
        ce._backward(one, x, t, lse, random_host(rng, (4, 16), "float16"), opts, donate=False)
    with pytest.raises(ValueError, match="unit"):
        ce._backward(one, x, t, lse, random_host(rng, (4, 32), "float32")[:, ::2], opts, donate=False)
    with pytest.raises(ValueError, match="unit"):
        ce._backward(one, x, t, lse, None, opts, donate=True)


# ---- linear cross-entropy -----------------------------------------------------------------------

@pytest.fixture
def chunks_on_the_host_factory(host_arrays_as_device, monkeypatch):
    """chunks_on_the_host with the chunk budget given (bytes of logits a chunk)."""
    monkeypatch.setattr(ce._faults, "record", lambda device: np.zeros(3, np.int64))

    def count(ta, v, opts):
        t = ta.obj
        return _Obj(np.array([np.sum((t != opts.ignore_index) & (t >= 0) & (t < v))], np.float32))

    def kw(opts):
        return dict(ignore_index=opts.ignore_index, label_smoothing=opts.smoothing, z_loss=opts.z_loss,
                    softcap=opts.softcap or None)

    def forward(logits, target, opts):
        return np.asarray(ref.cross_entropy(logits, target, reduction="none", **kw(opts))).astype(np.float32)

    def train(logits, target, count, opts):
        loss, d = ref.cross_entropy_forward_backward(logits, target, reduction="sum", **kw(opts))
        rows = np.asarray(ref.cross_entropy(logits, target, reduction="none", **kw(opts))).astype(np.float32)
        # (as the kernel: ignored rows get exactly 0, also when the batch keeps no row at all)
        logits[...] = d / count[0] if count is not None and count[0] else d
        return rows

    monkeypatch.setattr(ce.linear, "_count_valid", count)
    monkeypatch.setattr(ce.linear, "_chunk_forward", forward)
    monkeypatch.setattr(ce.linear, "_chunk_train", train)
    return lambda budget: monkeypatch.setattr(ce.linear, "CHUNK_BYTES", budget)


@pytest.fixture
def chunks_on_the_host(chunks_on_the_host_factory):
    """The linear cross-entropy's kernel steps replaced by the references on NumPy arrays (and a
    small chunk budget, so that several chunks run): its chunking, accumulation and scaling run
    on the CPU."""
    chunks_on_the_host_factory(7 * 50 * 4)   # 7 tokens of 50 float32 logits: 4-token chunks


class _Obj:
    def __init__(self, obj):
        self.obj = obj


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_linear_cross_entropy_chunks_add_up_to_the_whole(chunks_on_the_host, bias, reduction):
    rng = np.random.default_rng(7)
    h = random_host(rng, (3, 5, 16), "float32")      # 15 tokens: chunks of 4, 4, 4, 3
    w = random_host(rng, (50, 16), "float32", 0.5)
    b = random_host(rng, (50,), "float32") if bias else None
    t = _targets(rng, 15, 50).reshape(3, 5)
    opts = dict(label_smoothing=0.1, z_loss=1e-3, reduction=reduction)
    assert ce.chunk_rows(15, 50, 4) == 4
    loss, dh, dw, db = cukern.linear_cross_entropy_forward_backward(h, w, t, b, **opts)
    rloss, rdh, rdw, rdb = ref.linear_cross_entropy_forward_backward(h, w, t, b, **opts)
    assert_close(np.asarray(loss), rloss, "float32", "loss", tol=1e-5)
    assert_close(dh, rdh, "float32", "dhidden", tol=1e-5)
    assert_close(dw, rdw, "float32", "dweight", tol=1e-5)
    if bias:
        assert_close(db, rdb, "float32", "dbias", tol=1e-5)
    else:
        assert db is None
    assert_close(np.asarray(cukern.linear_cross_entropy(h, w, t, b, **opts)), rloss, "float32", "loss", tol=1e-5)
    none = cukern.linear_cross_entropy(h, w, t, b, reduction="none")
    assert_close(none, ref.linear_cross_entropy(h, w, t, b, reduction="none"), "float32", "loss rows", tol=1e-5)


def test_linear_cross_entropy_checks_its_arguments(dry):
    h, w, t = np.ones((4, 8), np.float16), np.ones((10, 8), np.float16), np.arange(4)
    for args, kw, exc, pattern in [
        ((h, np.ones((10, 7), np.float16), t), {}, ValueError, r"weight: must be \(V, 8\)"),
        ((h, w.astype(np.float32), t), {}, ValueError, "weight: dtype float32 differs from hidden's float16"),
        ((h, w, t[:3]), {}, ValueError, "target: shape"),
        ((h, w, t, np.ones(9, np.float16)), {}, ValueError, "bias: shape"),
        ((h, w, t), {"reduction": "none"}, ValueError, "reduction: the training form"),
    ]:
        for fn in (cukern.linear_cross_entropy_forward_backward, ref.linear_cross_entropy_forward_backward):
            with pytest.raises(exc, match=pattern):
                fn(*args, **kw)


def test_linear_cross_entropy_on_bfloat16_cupy_arrays_says_what_to_pass(dry, monkeypatch):
    from cukern import _arrays

    real = _arrays.as_device_array

    def as_cupy(obj, name, dtypes=_arrays.FLOATS):
        a = real(obj, name, dtypes)
        a.kind = "cupy"
        return a

    monkeypatch.setattr(_arrays, "as_device_array", as_cupy)
    h, w = (np.ones(s, np.float32).astype(ce._arrays._np_dtype("bfloat16")) for s in ((4, 8), (10, 8)))
    with pytest.raises(TypeError, match="hidden: CuPy has no bfloat16 matrix product; pass torch tensors"):
        cukern.linear_cross_entropy(h, w, np.arange(4))


def test_chunks_hold_at_most_the_budget_of_logits():
    assert ce.chunk_rows(16384, 128256, 2) == 2048           # 501 MiB of bf16 logits
    assert ce.chunk_rows(16384, 128256, 2) * 128256 * 2 <= ce.CHUNK_BYTES
    assert ce.chunk_rows(100, 128256, 2) == 128              # never more than the tokens need
    assert ce.chunk_rows(16384, 128256, 2, budget=128 << 20) == 512
    assert ce.chunk_rows(5, 10**9, 4) == 1                   # at least one token


@gpu
@needs_torch
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_cross_entropy_matches_the_reference_on_the_gpu(dtype, bias, monkeypatch):
    monkeypatch.setattr(ce.linear, "CHUNK_BYTES", 64 * 3000 * 2)   # several chunks
    rng = np.random.default_rng(8)
    h = random_host(rng, (300, 64), dtype)
    w = random_host(rng, (3000, 64), dtype, 0.2)
    b = random_host(rng, (3000,), dtype) if bias else None
    t = _targets(rng, 300, 3000)
    dev = [to_device(a, "torch") if a is not None else None for a in (h, w, b)]
    loss, dh, dw, db = cukern.linear_cross_entropy_forward_backward(*dev[:2], _indices(t, "torch"), dev[2],
                                                                    label_smoothing=0.1)
    rloss, rdh, rdw, rdb = ref.linear_cross_entropy_forward_backward(h, w, t, b, label_smoothing=0.1)
    tol = {"float32": 1e-4, "bfloat16": 3e-2}[dtype]   # (half logits are rounded before the loss)
    assert_close(loss, rloss, dtype, "loss", tol=tol, scale=1.0)
    assert_close(dh, rdh, dtype, "dhidden", tol=tol)
    assert_close(dw, rdw, dtype, "dweight", tol=tol)
    if bias:
        assert_close(db, rdb, dtype, "dbias", tol=tol)
    assert_close(cukern.linear_cross_entropy(*dev[:2], _indices(t, "torch"), dev[2], label_smoothing=0.1),
                 rloss, dtype, "loss", tol=tol, scale=1.0)


@gpu
@needs_torch
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_linear_cross_entropy_rounds_dweight_once_however_many_chunks(dtype, monkeypatch):
    """dweight of 32 chunks against one chunk: the chunks' products accumulate in float32 and
    are rounded once, so at most the float32 summation order differs (a 16-bit rounding per
    chunk moved most elements by several units in the last place)."""
    rng = np.random.default_rng(11)
    tokens, v, hdim = 1024, 512, 64
    h, w = (to_device(random_host(rng, s, dtype), "torch") for s in ((tokens, hdim), (v, hdim)))
    t = _indices(_targets(rng, tokens, v), "torch")
    monkeypatch.setattr(ce.linear, "CHUNK_BYTES", v * tokens * 2)
    _, dh1, dw1, _ = cukern.linear_cross_entropy_forward_backward(h, w, t)
    monkeypatch.setattr(ce.linear, "CHUNK_BYTES", v * (tokens // 32) * 2)
    assert ce.chunk_rows(tokens, v, 2) == tokens // 32
    _, dh32, dw32, _ = cukern.linear_cross_entropy_forward_backward(h, w, t)
    assert dw32.dtype == w.dtype
    for name, one, many in (("dhidden", dh1, dh32), ("dweight", dw1, dw32)):
        a, b = one.float(), many.float()
        fi = torch.finfo(w.dtype)   # (a unit in the last place, subnormals' below float16's tiny)
        ulp = torch.clamp(fi.eps * torch.maximum(a.abs(), b.abs()), min=fi.eps * fi.tiny)
        assert bool(((a - b).abs() <= ulp).all()), f"{name} moved by more than one unit in the last place"
        assert float((a == b).float().mean()) > 0.95, name


def test_a_chunk_of_the_linear_form_scales_by_the_whole_batchs_count(dry):
    from cukern import _kernels

    logits, t, count = np.ones((4, 64), np.float16), np.arange(4), np.ones(1, np.float32)
    plan = _plan(lambda: ce.linear._chunk_train(logits, t, count, ce._options(-100, 0, 0, None, "mean")))
    assert list(_launches(plan)) == ["cross_entropy_rows"]     # no count of its own, no reduction
    _, inst, _, _, _, slots = plan.steps[0]
    names = _kernels.signature(inst).names
    by_name = {names[at]: slot for at, slot, _ in slots}
    assert by_name["count"] == 2                                # the batch's count, given
    assert by_name["dlogits"] == 0 == by_name["logits"]         # the gradient over the chunk's logits
    assert by_name["loss_rows"] == 3                            # per-row float32 losses, the output


# ---- the family's rows in the shared PyTorch-path tests (tests/test_torch_integration.py) ----

def torch_stand_ins() -> dict:
    import torch.nn.functional as F

    def ce(x, t, ignore, smoothing, z, cap, reduction, f32):
        with torch.enable_grad():   # (Function.forward runs without it)
            xl = x.detach().requires_grad_(True)
            loss = F.cross_entropy(xl, t, ignore_index=ignore, label_smoothing=smoothing, reduction=reduction)
            return loss.detach(), torch.autograd.grad(loss, xl, torch.ones_like(loss))[0]

    def lce(h, w, t, b, ignore, smoothing, z, cap, reduction, f32):
        with torch.enable_grad():
            leaves = [a.detach().requires_grad_(True) for a in (h, w) + ((b,) if b is not None else ())]
            logits = F.linear(leaves[0], leaves[1], leaves[2] if b is not None else None)
            loss = F.cross_entropy(logits, t, ignore_index=ignore, label_smoothing=smoothing, reduction=reduction)
            grads = torch.autograd.grad(loss, leaves)
        return loss.detach(), grads[0], grads[1], grads[2] if b is not None else h.new_empty((0,))

    def ce_train(x, t, ignore, smoothing, z, cap, reduction, f32):
        loss, d = ce(x, t, ignore, smoothing, z, cap, reduction, f32)
        return loss, d, torch.logsumexp(x.float(), -1)

    def ce_backward(dloss, unit, x, t, lse, ignore, smoothing, z, cap, reduction):
        return ((unit * dloss if dloss.dim() == 0 else unit * dloss[:, None]),)

    return {"cross_entropy": (ce_train, ce_backward),
            "linear_cross_entropy": (lce, lambda dl, dh, dw, db, dt: (dh * dl, dw * dl,
                                                                      db * dl if db.numel() else None))}


def torch_wiring_calls(which: str, g) -> list:
    import torch.nn.functional as F

    logits = torch.randn(6, 11, generator=g).requires_grad_(which != "w")
    target = torch.tensor([0, 3, -100, 10, 2, 2])
    hid = torch.randn(6, 16, generator=g).requires_grad_(which != "w")
    head = torch.randn(11, 16, generator=g).requires_grad_(which in ("w", "both"))
    hb = torch.randn(11, generator=g).requires_grad_(which == "both")
    return [("linear_cross_entropy", (hid, head, target, hb, -100, 0.1, 0.0, 0.0, "sum", False),
             lambda: F.cross_entropy(F.linear(hid, head, hb), target, label_smoothing=0.1, reduction="sum"),
             (hid, head, hb)),
            ("cross_entropy", (logits, target, -100, 0.1, 0.0, 0.0, "none", False),
             lambda: F.cross_entropy(logits, target, label_smoothing=0.1, reduction="none"), (logits,))]


def opcheck_samples() -> list:
    from torch_helpers import leaf

    ops, bf = torch.ops.cukern, torch.bfloat16
    target = torch.randint(0, 300, (9,), device="cuda")
    return [(ops.cross_entropy.default, (leaf((9, 300), bf, 0), target, -100, 0.1, 1e-3, 0.0, "mean", False)),
            (ops.cross_entropy.default, (leaf((9, 300), bf, 0), target, 3, 0.0, 0.0, 5.0, "none", True)),
            (ops.linear_cross_entropy.default, (leaf((9, 32), bf, 0), leaf((300, 32), bf, 1), target,
                                                leaf((300,), bf, 2), -100, 0.1, 1e-3, 0.0, "mean", False))]


def torch_kernel_cases() -> dict:
    import cukern.torch as ct
    from torch_helpers import leaf

    x = leaf((512, 1024), torch.bfloat16, 0)
    t = torch.randint(0, 1024, (512,), device="cuda")
    one = torch.ones((), device="cuda", dtype=torch.bfloat16)
    return {"cross_entropy": (lambda: torch.autograd.grad(ct.cross_entropy(x, t), (x,), one),
                              # (the forward's count, rows and reduce; the backward's count and rows)
                              ["cross_entropy_count", "cross_entropy_count", "cross_entropy_reduce",
                               "cross_entropy_rows", "cross_entropy_rows"])}


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tokens=st.integers(0, 40), v=st.integers(1, 60), h=st.integers(1, 24), chunk=st.integers(1, 64),
       bias=st.booleans(), reduction=st.sampled_from(["mean", "sum"]), smoothing=st.sampled_from([0.0, 0.2]),
       z_loss=st.sampled_from([0.0, 1e-2]), softcap=st.sampled_from([None, 3.0]), seed=st.integers(0, 2**16))
def test_linear_cross_entropy_chunking_for_any_shape(tokens, v, h, chunk, bias, reduction, smoothing, z_loss, softcap,
                                                     seed, chunks_on_the_host_factory):
    """The chunked linear form equals the whole one for any token count (none included), chunk
    size, vocabulary, hidden size and option (the kernels' steps by their references; the
    fixture's patches hold for every example, each sets its own chunk budget)."""
    chunks_on_the_host_factory(chunk * v * 4)
    rng = np.random.default_rng(seed)
    hid = random_host(rng, (tokens, h), "float32")
    w = random_host(rng, (v, h), "float32", 0.5)
    b = random_host(rng, (v,), "float32") if bias else None
    t = _targets(rng, tokens, v, 0.3)
    opts = dict(label_smoothing=smoothing, z_loss=z_loss, softcap=softcap, reduction=reduction)
    got = cukern.linear_cross_entropy_forward_backward(hid, w, t, b, **opts)
    expect = ref.linear_cross_entropy_forward_backward(hid, w, t, b, **opts)
    if np.isnan(expect[0]):   # "mean" with every row ignored (or no rows)
        assert np.isnan(got[0])
    else:
        assert_close(np.asarray(got[0]), expect[0], "float32", "loss", tol=1e-5, scale=1.0)
    for g, e, name in zip(got[1:], expect[1:], ("dhidden", "dweight", "dbias")):
        if e is None:
            assert g is None
        else:
            assert_close(g, e, "float32", name, tol=1e-5, scale=1e-3)
