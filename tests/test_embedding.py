"""Embedding: the references (no GPU), argument checking, and the kernels against the
references and against torch (GPU), including out-of-range indices and determinism."""
from __future__ import annotations

import importlib

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import cukern
from cukern import reference as ref

from arrays import (FLOAT_DTYPES, TOL, assert_close, poison_allocator, random_host, spin,
                    to_device, to_host, torch)

gpu = pytest.mark.gpu
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")
# The front may be written after these tests: collection must not fail without it.
embedding = getattr(cukern, "embedding", None)
embedding_backward = getattr(cukern, "embedding_backward", None)
needs_api = pytest.mark.skipif(embedding is None or embedding_backward is None,
                               reason="cukern.embedding / cukern.embedding_backward do not exist yet")

INDEX_SHAPES = [(), (0,), (1,), (7,), (3, 5), (2, 3, 4)]
VOCABS = [1, 2, 17, 1000, 50000]
DIMS = [1, 3, 8, 9, 64, 100, 1024, 4096, 4099]
DISTS = ["uniform", "same", "hot", "zipf"]
INDEX_DTYPES = ("int32", "int64")
FRAMEWORKS = ["cupy", "torch"] if torch is not None else ["cupy"]
MAX_TABLE = 1 << 23  # V * D elements drawn at most (the weight, the dense gradient, float64 refs)


def draw_indices(rng: np.random.Generator, shape, num_embeddings: int, dist: str, dtype="int64"):
    """Indices in [0, V) of ``shape`` from one of DISTS:
    uniform; all the same index; "hot": most tokens (~85%) one of 3 values; "zipf":
    np.random.zipf(1.3) - 1 clipped to V - 1 (index 0 most frequent, a heavy tail on V - 1)."""
    v = num_embeddings
    if dist == "uniform":
        idx = rng.integers(0, v, size=shape)
    elif dist == "same":
        idx = np.full(shape, rng.integers(0, v))
    elif dist == "hot":
        hot = rng.integers(0, v, size=3)
        idx = np.where(rng.random(shape) < 0.85, hot[rng.integers(0, 3, size=shape)],
                       rng.integers(0, v, size=shape))
    elif dist == "zipf":
        idx = np.minimum(rng.zipf(1.3, size=shape) - 1, v - 1)
    else:
        raise ValueError(dist)
    return np.asarray(idx).astype(dtype).reshape(shape)


def max_count(indices, num_embeddings: int, padding_idx=None) -> int:
    """How often the most frequent index that receives gradient occurs (at least 1)."""
    flat = np.asarray(indices).reshape(-1).astype(np.int64)
    if padding_idx is not None:
        flat = flat[flat != padding_idx % num_embeddings]
    return int(np.bincount(flat, minlength=num_embeddings).max()) if flat.size else 1


def grad_tolerance(dtype: str, count: int, grad_rms: float, scale_grad_by_freq: bool):
    """(tol, scale) for assert_close of a weight gradient whose rows sum up to ``count`` terms
    of magnitude ``grad_rms``. The kernel sums in float32 and rounds once at the end: for
    bf16/fp16 that rounding dominates (TOL). float32 sums of n terms err by about
    eps32 * sqrt(n) relative to the sum's scale sqrt(n) * |term| (a random walk): that scale
    is passed to assert_close and the tolerance grows with sqrt(n) beyond 1e-5."""
    tol = TOL[dtype]
    if dtype == "float32":
        tol = max(tol, 2 * 2.0**-24 * np.sqrt(count))
    scale = grad_rms * np.sqrt(count) / (count if scale_grad_by_freq else 1)
    return tol, scale


def _dtype_name(a) -> str:
    return str(a.dtype).replace("torch.", "")


def _check_kind(out, like, name: str):
    assert type(out) is type(like), f"{name}: returned {type(out).__name__} for {type(like).__name__} input"
    assert _dtype_name(out) == _dtype_name(like), f"{name}: dtype {out.dtype} != {like.dtype}"
    if torch is not None and isinstance(like, torch.Tensor):
        assert out.device == like.device, f"{name}: on {out.device}, input on {like.device}"


def indices_device(host: np.ndarray, framework: str, layout: str = "contiguous"):
    """A device copy of the integer array ``host`` (to_device only does float arrays), either
    contiguous or as a strided view whose skipped elements are out-of-range values (a kernel
    that ignores the stride reads them, and both its output and check_errors() show it)."""
    if layout == "strided":
        junk = np.full(host.shape, -7, dtype=host.dtype)
        host = np.stack([host, junk], axis=-1)
    if framework == "torch":
        d = torch.from_numpy(host.copy(order="C")).cuda()  # (ascontiguousarray: 0-d -> 1-d)
    else:
        import cupy

        d = cupy.asarray(host)
    return d[..., 0] if layout == "strided" else d


def rows_device(host: np.ndarray, framework: str, layout: str = "contiguous"):
    """A device copy of a float array, or a view of the rows of a wider buffer (last axis
    unit-stride, row stride > width)."""
    if layout == "contiguous":
        return to_device(host, framework)
    pad = np.concatenate([host, host[..., :1], host[..., :1], host[..., :1]], axis=-1)
    return to_device(pad, framework)[..., : host.shape[-1]]


def clear_faults() -> None:
    """Forget faults a failed test left behind (check_errors clears the record)."""
    try:
        cukern.check_errors()
    except IndexError:
        pass


# ---- the references, no GPU -------------------------------------------------------------------

@pytest.mark.parametrize("shape", INDEX_SHAPES)
@pytest.mark.parametrize("dist", DISTS)
def test_reference_backward_equals_a_python_loop(shape, dist):
    rng = np.random.default_rng(len(shape) * 10 + DISTS.index(dist))
    v, d = 6, 5
    idx = draw_indices(rng, shape, v, dist)
    grad = rng.standard_normal(shape + (d,))
    for padding_idx in (None, 2, -1):
        for scale in (False, True):
            expect = np.zeros((v, d))
            count = np.zeros(v)
            for t in np.ndindex(*shape):
                expect[idx[t]] += grad[t]
                count[idx[t]] += 1
            if scale:
                expect /= np.maximum(count, 1)[:, None]
            if padding_idx is not None:
                expect[padding_idx] = 0.0
            got = ref.embedding_backward(grad, idx, v, padding_idx, scale)
            assert got.dtype == np.float64 and got.shape == (v, d)
            np.testing.assert_allclose(got, expect, rtol=1e-13, atol=1e-13)


def test_reference_forward_is_the_rows_and_float64():
    rng = np.random.default_rng(1)
    w = random_host(rng, (9, 4), "bfloat16")
    idx = np.array([[8, 0], [3, 3]], np.int32)
    out = ref.embedding(idx, w, padding_idx=3)
    assert out.dtype == np.float64 and out.shape == (2, 2, 4)
    np.testing.assert_array_equal(out[1, 0], w[3].astype(np.float64))
    np.testing.assert_array_equal(out[0, 0], w[8].astype(np.float64))
    assert ref.embedding(np.array(5), w).shape == (4,)
    assert ref.embedding(np.zeros((0, 3), np.int64), w).shape == (0, 3, 4)


def test_reference_out_of_range_and_bad_arguments():
    w = np.ones((4, 2))
    for bad in (-1, 4, 100):
        with pytest.raises(IndexError, match=rf"^indices: .*{bad}"):
            ref.embedding(np.array([0, bad]), w)
        with pytest.raises(IndexError, match=rf"^indices: .*{bad}"):
            ref.embedding_backward(np.ones((2, 2)), np.array([bad, 1]), 4)
    for p in (4, -5):
        with pytest.raises(ValueError, match="^padding_idx: "):
            ref.embedding(np.array([0]), w, padding_idx=p)
    with pytest.raises(ValueError, match="^indices: dtype"):
        ref.embedding(np.array([0.0]), w)
    with pytest.raises(ValueError, match="^weight: "):
        ref.embedding(np.array([0]), np.ones(4))
    with pytest.raises(ValueError, match=r"^grad: shape"):
        ref.embedding_backward(np.ones((3, 2)), np.array([0, 1]), 4)
    for n in (0, -1):
        with pytest.raises(ValueError, match="^num_embeddings: "):
            ref.embedding_backward(np.ones((2, 2)), np.array([0, 1]), n)
    for n in (2.5, "4", True):   # as the kernels: an int is required
        with pytest.raises(TypeError, match="^num_embeddings: expected an int"):
            ref.embedding_backward(np.ones((2, 2)), np.array([0, 1]), n)


@needs_torch
@pytest.mark.parametrize("shape", INDEX_SHAPES)
@pytest.mark.parametrize("idx_dtype", INDEX_DTYPES)
def test_reference_matches_torch_cpu_float64(shape, idx_dtype):
    F = torch.nn.functional
    rng = np.random.default_rng(2 + len(shape))
    v, d = 11, 7
    w = rng.standard_normal((v, d))
    for dist in DISTS:
        idx = draw_indices(rng, shape, v, dist, idx_dtype)
        grad = rng.standard_normal(shape + (d,))
        for padding_idx in (None, int(idx.flat[0]) if idx.size else 3, -2):
            np.testing.assert_array_equal(
                ref.embedding(idx, w, padding_idx),
                F.embedding(torch.from_numpy(idx), torch.from_numpy(w), padding_idx=padding_idx).numpy())
            for scale in (False, True):
                wt = torch.from_numpy(w.copy()).requires_grad_()
                out = F.embedding(torch.from_numpy(idx), wt, padding_idx=padding_idx, scale_grad_by_freq=scale)
                (expect,) = torch.autograd.grad(out, wt, torch.from_numpy(grad))
                np.testing.assert_allclose(ref.embedding_backward(grad, idx, v, padding_idx, scale),
                                           expect.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dist", DISTS)
def test_draw_indices_stay_in_range(dist):
    rng = np.random.default_rng(3)
    for v in VOCABS:
        idx = draw_indices(rng, (2000,), v, dist, "int32")
        assert idx.dtype == np.int32 and idx.min() >= 0 and idx.max() < v
    if dist != "uniform":  # heavy repetition is what those distributions are for
        assert max_count(draw_indices(rng, (2000,), 50000, dist), 50000) > 100


# ---- argument checking that needs no GPU ------------------------------------------------------

@needs_api
def test_host_arrays_are_type_errors_naming_the_argument_and_the_reference():
    idx, w = np.array([0, 1]), np.ones((4, 8), np.float32)
    with pytest.raises(TypeError, match=r"^(indices|weight): a host.*cukern\.reference"):
        cukern.embedding(idx, w)
    with pytest.raises(TypeError, match=r"^(grad|indices): a host.*cukern\.reference"):
        cukern.embedding_backward(np.ones((2, 8), np.float32), idx, 4)
    with pytest.raises(TypeError, match=r"^(grad|indices): a host"):
        cukern.embedding_backward(np.ones((2, 8), np.float32), idx, 4, padding_idx=1,
                                  scale_grad_by_freq=True, check=True)


@needs_api
def test_none_is_a_type_error():
    with pytest.raises(TypeError, match="^(indices|weight): "):
        cukern.embedding(None, None)


@needs_api
@needs_torch
def test_cpu_tensors_are_type_errors():
    idx, w = torch.tensor([0, 1]), torch.ones(4, 8)
    with pytest.raises(TypeError, match=r"^(indices|weight): a torch tensor on cpu"):
        cukern.embedding(idx, w)
    with pytest.raises(TypeError, match=r"^(grad|indices): a torch tensor on cpu"):
        cukern.embedding_backward(torch.ones(2, 8), idx, 4)


@needs_api
@pytest.mark.parametrize("ntok, v, d, dtype, passes, threads", [
    (5, 1, 8, "float32", 1, 128),
    (1000, 511, 64, "bfloat16", 1, 128),          # 511 and padding's index 511: nine bits
    (1000, 512, 1024, "float16", 2, 128),         # padding's index 512: ten bits, two passes
    (70000, 128256, 2048, "bfloat16", 2, 256),
    (300, 262144, 4096, "bfloat16", 3, 512),      # Gemma's vocabulary: nineteen bits
    (300, 1000, 4099, "float32", 2, 512),         # scalar loads: two vectors a thread, column tiles
])
def test_every_call_builds_its_plan_against_the_kernels_declarations(host_arrays_as_device, monkeypatch,
                                                                     ntok, v, d, dtype, passes, threads):
    """Forward and backward reach their launch plans on the CPU, each launch's arguments packed
    by name, C type and dtype against cuda_src/embedding.cu's declarations. The backward's sort
    takes a launch a 9-bit digit of the indices, V (padding's index) included; its sums kernel
    a thread shape by the row's width, chunks of 64 or 128 entries, at most 256 rows to zero a
    unit."""
    from conftest import DryRun

    from cukern import _faults

    monkeypatch.setattr(_faults, "record", lambda device: np.zeros(3, np.int64))
    rng = np.random.default_rng(ntok)
    idx = draw_indices(rng, (ntok,), v, "uniform", "int64")
    with pytest.raises(DryRun):
        cukern.embedding(idx, random_host(rng, (v, d), dtype))
    with pytest.raises(DryRun) as run:
        cukern.embedding_backward(random_host(rng, (ntok, d), dtype), idx, v, 0, True)
    launches = [s for s in run.value.plan.steps if isinstance(s, tuple)]
    assert [s[1].kernel_name for s in launches] == ["embedding_bwd_keys", *["embedding_bwd_sort_pass"] * passes,
                                                    "embedding_bwd_chunks", "embedding_bwd_combine"]
    sums = launches[1 + passes]
    assert sums[1].threads == threads
    assert sums[4]["C"] in (64, 128) and 1 <= sums[4]["zrows"] <= 256
    assert sums[4]["nunits"] * sums[4]["zrows"] >= v and sums[4]["nchunks"] * sums[4]["C"] >= ntok
    for p, s in enumerate(launches[1:1 + passes]):
        assert s[4]["shift"] == 9 * p and (s[4]["next_shift"] == 9 * (p + 1))


# ---- the kernels against the references (GPU) ---------------------------------------------------

@st.composite
def embedding_cases(draw):
    d = draw(st.sampled_from(DIMS))
    v = draw(st.sampled_from([v for v in VOCABS if v * d <= MAX_TABLE]))
    return dict(
        shape=draw(st.sampled_from(INDEX_SHAPES)),
        V=v,
        D=d,
        dtype=draw(st.sampled_from(FLOAT_DTYPES)),
        idx_dtype=draw(st.sampled_from(INDEX_DTYPES)),
        framework=draw(st.sampled_from(FRAMEWORKS)),
        dist=draw(st.sampled_from(DISTS)),
        padding=draw(st.sampled_from(["none", "used", "negative"])),
        scale=draw(st.booleans()),
        layout=draw(st.sampled_from(["contiguous", "contiguous", "strided"])),
        seed=draw(st.integers(0, 2**31 - 1)),
    )


def _case_inputs(c):
    """(rng, host indices, padding_idx) of a drawn case."""
    rng = np.random.default_rng(c["seed"])
    idx = draw_indices(rng, c["shape"], c["V"], c["dist"], c["idx_dtype"])
    if c["padding"] == "none":
        padding_idx = None
    else:  # a row that occurs in the indices when there are any, so that it matters
        p = int(idx.flat[rng.integers(0, idx.size)]) if idx.size else int(rng.integers(0, c["V"]))
        padding_idx = p - c["V"] if c["padding"] == "negative" else p
    return rng, idx, padding_idx


@gpu
@settings(max_examples=60)
@given(c=embedding_cases())
def test_embedding_matches_reference(c):
    rng, idx, padding_idx = _case_inputs(c)
    v, d, dtype, fw = c["V"], c["D"], c["dtype"], c["framework"]
    w = random_host(rng, (v, d), dtype)
    idx_d = indices_device(idx, fw, c["layout"])
    w_d = rows_device(w, fw, c["layout"])
    poison_allocator(fw, [idx.size * d * w.itemsize] * 2)
    out = cukern.embedding(idx_d, w_d, padding_idx)
    _check_kind(out, w_d, "out")
    expect = ref.embedding(idx, w, padding_idx)
    assert tuple(out.shape) == c["shape"] + (d,)
    got = to_host(out)
    assert not np.isnan(got).any(), "out: NaN (unwritten element?)"
    np.testing.assert_array_equal(got, expect, err_msg="out: a lookup is an exact copy of the row")
    cukern.check_errors()  # in-range indices record no fault


@gpu
@settings(max_examples=60)
@given(c=embedding_cases())
def test_embedding_backward_matches_reference(c):
    rng, idx, padding_idx = _case_inputs(c)
    v, d, dtype, fw = c["V"], c["D"], c["dtype"], c["framework"]
    grad = random_host(rng, c["shape"] + (d,), dtype)
    idx_d = indices_device(idx, fw, c["layout"])
    grad_d = rows_device(grad, fw, c["layout"])
    poison_allocator(fw, [v * d * grad.itemsize, v * d * 4, idx.size * d * 4, idx.size * 8])
    out = cukern.embedding_backward(grad_d, idx_d, v, padding_idx, c["scale"])
    _check_kind(out, grad_d, "dweight")
    assert tuple(out.shape) == (v, d)
    expect = ref.embedding_backward(grad, idx, v, padding_idx, c["scale"])
    tol, scale = grad_tolerance(dtype, max_count(idx, v, padding_idx), 1.0, c["scale"])
    assert_close(out, expect, dtype, "dweight", tol=tol, scale=scale)
    got = to_host(out)
    assert np.all(got[expect == 0] == 0), "dweight: rows never looked up (or padding) must be zero"
    cukern.check_errors()


@gpu
@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("shape", [(), (0,), (0, 5)])
def test_scalar_and_empty_indices(framework, shape):
    rng = np.random.default_rng(5)
    w = random_host(rng, (17, 9), "bfloat16")
    idx = draw_indices(rng, shape, 17, "uniform", "int64")
    w_d = to_device(w, framework)
    out = cukern.embedding(indices_device(idx, framework), w_d)
    assert tuple(out.shape) == shape + (9,)
    np.testing.assert_array_equal(to_host(out), ref.embedding(idx, w))
    grad = random_host(rng, shape + (9,), "bfloat16")
    poison_allocator(framework, [17 * 9 * 2, 17 * 9 * 4])
    dw = cukern.embedding_backward(to_device(grad, framework), indices_device(idx, framework), 17, 3, True)
    _check_kind(dw, w_d, "dweight")
    assert_close(dw, ref.embedding_backward(grad, idx, 17, 3, True), "bfloat16", "dweight")
    cukern.check_errors()


@gpu
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("dist", ["zipf", "same"])
def test_backward_many_repeated_tokens_is_deterministic_and_right(dist, dtype):
    """20000 tokens, one index up to 20000 times: long runs are split across blocks and summed
    in a fixed order, so every run gives the same bytes; float32 sums, one rounding."""
    import cupy

    v, d = 32000, 1024
    rng = np.random.default_rng(7)
    idx = draw_indices(rng, (20000,), v, dist, "int64")
    grad = random_host(rng, (20000, d), dtype)
    idx_d, grad_d = cupy.asarray(idx), to_device(grad, "cupy")
    runs = []
    for _ in range(3):
        poison_allocator("cupy", [v * d * grad.itemsize, v * d * 4])
        runs.append(cupy.asnumpy(cukern.embedding_backward(grad_d, idx_d, v)))
    for other in runs[1:]:
        assert other.tobytes() == runs[0].tobytes(), "embedding_backward is not bitwise deterministic"
    expect = ref.embedding_backward(grad, idx, v)
    tol, scale = grad_tolerance(dtype, max_count(idx, v), 1.0, False)
    assert_close(runs[0], expect, dtype, "dweight", tol=tol, scale=scale)
    # padding and frequency scaling on the same heavy runs, in bf16 and with int32 indices
    hot = int(np.bincount(idx).argmax())
    for padding_idx, scale_freq in ((hot, False), (None, True), (-1, True)):
        out = cukern.embedding_backward(grad_d, cupy.asarray(idx.astype(np.int32)), v, padding_idx, scale_freq)
        again = cukern.embedding_backward(grad_d, cupy.asarray(idx.astype(np.int32)), v, padding_idx, scale_freq)
        assert cupy.asnumpy(out).tobytes() == cupy.asnumpy(again).tobytes()
        expect = ref.embedding_backward(grad, idx, v, padding_idx, scale_freq)
        tol, scale = grad_tolerance(dtype, max_count(idx, v, padding_idx), 1.0, scale_freq)
        assert_close(out, expect, dtype, f"dweight (padding_idx={padding_idx}, scale={scale_freq})",
                     tol=tol, scale=scale)
    cukern.check_errors()


@gpu
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("ntok, v, d, dist", [
    (20000, 30000, 520, "uniform"),    # many chunks, runs across their boundaries, 16-byte vectors
    (20000, 30000, 1030, "zipf"),      # scalar loads, three column tiles, a few very long runs
    (100, 40000, 64, "uniform"),       # far more table than tokens: units that only zero rows
    (5000, 3, 8, "hot"),               # a table smaller than one unit's rows
    (50000, 300000, 8, "uniform"),     # indices of 19 bits: three passes of the keys' sort
])
def test_backward_units_sum_every_chunk_and_zero_every_other_row(ntok, v, d, dist, dtype):
    """The keys' sort takes a pass a 9-bit digit of the indices; the sums kernel takes units of
    sorted entries and, beside them, slices of the table whose untouched rows it zeroes: every
    row must be written, looked up or not, whatever the unit split (the allocator hands out
    NaN, so a row missed shows)."""
    import cupy

    rng = np.random.default_rng(ntok + v + d)
    idx = draw_indices(rng, (ntok,), v, dist, "int64")
    grad = random_host(rng, (ntok, d), dtype)
    poison_allocator("cupy", [v * d * grad.itemsize, v * d * 4])
    out = cukern.embedding_backward(to_device(grad, "cupy"), cupy.asarray(idx), v)
    got = to_host(out)
    assert not np.isnan(got).any(), "dweight: a row was never written"
    expect = ref.embedding_backward(grad, idx, v)
    assert np.all(got[expect == 0] == 0), "dweight: rows never looked up must be zero"
    tol, scale = grad_tolerance(dtype, max_count(idx, v), 1.0, False)
    assert_close(out, expect, dtype, "dweight", tol=tol, scale=scale)
    cukern.check_errors()


@gpu
@pytest.mark.parametrize("ntok, v, dist, padding_idx", [
    (20000, 1000, "zipf", None),       # two passes, long runs
    (70000, 300000, "uniform", 5),     # three passes, 18 tiles, the last one partial, a padding row
    (3, 2, "same", None),              # one pass, one partial tile
])
def test_backward_sorts_its_keys_stably(ntok, v, dist, padding_idx):
    """The backward's radix sort orders its keys (index << 32 | position) as a sort of the
    whole keys would: by index, equal indices in position order, padding (index V) last. One of
    the plan's two key buffers must hold exactly that order after the call."""
    import cupy

    emb = importlib.import_module("cukern.embedding")
    rng = np.random.default_rng(ntok + v)
    idx = draw_indices(rng, (ntok,), v, dist, "int64")
    grad = cupy.asarray(random_host(rng, (ntok, 8), "float32"))
    arrays = [cukern._arrays.as_device_array(grad, "grad"), emb._indices(cupy.asarray(idx))]
    plan = emb._plan_backward(list(arrays), v, padding_idx, False, emb.CONFIGS)
    bufs = plan(list(arrays))
    gives = np.where(idx == (padding_idx if padding_idx is not None else -1), v, idx)
    expect = np.sort((gives.astype(np.int64) << 32) | np.arange(ntok, dtype=np.int64))
    held = [cupy.asnumpy(b.obj) for b in bufs[len(arrays):]   # (what the plan allocated: not the indices)
            if b is not None and b.dtype == "int64" and b.shape == (ntok,)]
    assert len(held) == 2, "the plan holds its keys in two buffers of one int64 a token"
    assert any(np.array_equal(h, expect) for h in held), "no key buffer holds the keys in stable index order"


@gpu
def test_poisoning_reaches_the_next_allocation():
    """The poisoning above is only a check if the allocator really hands back NaN memory."""
    import cupy

    poison_allocator("cupy", [4096 * 2])
    assert np.isnan(cupy.asnumpy(cupy.empty(4096 // 2, np.float32))).any()
    if torch is not None:
        poison_allocator("torch", [4096 * 2])
        assert torch.isnan(torch.empty(4096 // 2, device="cuda")).any()


# ---- against torch (GPU) -------------------------------------------------------------------

@gpu
@needs_torch
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("padding_idx, scale_grad_by_freq", [(None, False), (7, False), (None, True), (-3, True)])
def test_against_torch_forward_and_autograd(dtype, padding_idx, scale_grad_by_freq):
    F = torch.nn.functional
    v, d = 5000, 1024
    tdt = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(13)
    rng = np.random.default_rng(13)
    idx_host = draw_indices(rng, (64, 256), v, "hot", "int64")
    idx_host[0, :50] = padding_idx % v if padding_idx is not None else 7  # the padding row occurs
    idx = torch.from_numpy(idx_host).cuda()
    w = torch.randn(v, d, device="cuda", dtype=tdt, generator=g, requires_grad=True)
    dy = torch.randn(64, 256, d, device="cuda", dtype=tdt, generator=g)
    y_t = F.embedding(idx, w, padding_idx=padding_idx, scale_grad_by_freq=scale_grad_by_freq)
    (dw_t,) = torch.autograd.grad(y_t, w, dy)

    y = cukern.embedding(idx, w.detach(), padding_idx)
    _check_kind(y, w, "y")
    assert torch.equal(y, y_t), "y: the lookup must equal torch's bit for bit"
    dw = cukern.embedding_backward(dy, idx, v, padding_idx, scale_grad_by_freq)
    _check_kind(dw, w, "dweight")
    count = max_count(idx_host, v, padding_idx)
    tol, scale = grad_tolerance(dtype, count, 1.0, scale_grad_by_freq)
    # Two roundings apart at most (torch's and ours): twice the reference tolerance.
    assert_close(dw, to_host(dw_t), dtype, "dweight vs torch", tol=2 * tol, scale=scale)
    expect = ref.embedding_backward(to_host(dy), idx_host, v, padding_idx, scale_grad_by_freq)
    assert_close(dw, expect, dtype, "dweight", tol=tol, scale=scale)
    if padding_idx is not None:
        assert not dw[padding_idx].any(), "dweight: the padding row must be zero"
    cukern.check_errors()


# ---- out-of-range indices (GPU) ---------------------------------------------------------------

BAD = [-1, -37, 37, 38, 1000, 2**31 - 1, -2**31, 2**32 + 3, -2**40]


@gpu
@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.parametrize("idx_dtype", INDEX_DTYPES)
@pytest.mark.parametrize("bad", BAD)
def test_out_of_range_indices_are_reported_not_read(bad, idx_dtype, framework):
    """No crash and no out-of-bounds read: the bad tokens' rows are zeros, the others right,
    the gradient has the in-range tokens' sum; check_errors() reports, then is clear.
    (2**32 + 3 must not wrap to row 3 as a 32-bit truncation would.)"""
    if not np.iinfo(idx_dtype).min <= bad <= np.iinfo(idx_dtype).max:
        pytest.skip(f"{bad} is not an {idx_dtype}")
    clear_faults()
    v, d = 37, 72
    rng = np.random.default_rng(abs(bad) % 1000)
    idx = draw_indices(rng, (4, 9), v, "uniform", idx_dtype)
    idx[1, 3] = bad
    idx[3, 8] = bad
    valid = (idx >= 0) & (idx < v)
    w = random_host(rng, (v, d), "float32")
    grad = random_host(rng, (4, 9, d), "float32")
    idx_d, w_d, grad_d = indices_device(idx, framework), to_device(w, framework), to_device(grad, framework)

    def expect_fault(what):
        with pytest.raises(IndexError, match="^indices: ") as e:
            cukern.check_errors()
        msg = str(e.value)
        assert str(bad) in msg and str(v) in msg, f"{what}: message names neither {bad} nor {v}: {msg}"
        cukern.check_errors()  # the record was cleared

    poison_allocator(framework, [idx.size * d * 4])
    out = cukern.embedding(idx_d, w_d)
    got = to_host(out)
    np.testing.assert_array_equal(got[valid], w[idx[valid]].astype(np.float64))
    np.testing.assert_array_equal(got[~valid], 0.0, err_msg="out-of-range rows must be zeros")
    expect_fault("embedding")

    poison_allocator(framework, [v * d * 4] * 2)
    dw = cukern.embedding_backward(grad_d, idx_d, v, padding_idx=0, scale_grad_by_freq=True)
    expect = ref.embedding_backward(grad[valid], idx[valid], v, 0, True)
    assert_close(dw, expect, "float32", "dweight (in-range tokens)", scale=1.0)
    expect_fault("embedding_backward")

    # check=True: the op validates on the host first and raises before launching anything
    with pytest.raises(IndexError, match="^indices: "):
        cukern.embedding(idx_d, w_d, check=True)
    with pytest.raises(IndexError, match="^indices: "):
        cukern.embedding_backward(grad_d, idx_d, v, check=True)
    cukern.check_errors()  # nothing ran, nothing recorded

    # and a valid call afterwards works, with or without check
    good = np.where(valid, idx, 5).astype(idx_dtype)
    for check in (False, True):
        out = cukern.embedding(indices_device(good, framework), w_d, check=check)
        np.testing.assert_array_equal(to_host(out), ref.embedding(good, w))
        dw = cukern.embedding_backward(grad_d, indices_device(good, framework), v, check=check)
        assert_close(dw, ref.embedding_backward(grad, good, v), "float32", "dweight", scale=1.0)
    cukern.check_errors()


@gpu
def test_out_of_range_in_a_large_launch():
    """Bad tokens scattered among many good ones (every block of the grid meets some)."""
    import cupy

    clear_faults()
    v, d = 1000, 256
    rng = np.random.default_rng(9)
    idx = draw_indices(rng, (50000,), v, "zipf", "int32")
    bad_at = rng.choice(idx.size, 300, replace=False)
    idx[bad_at] = rng.choice([-5, v, v + 1, 2**31 - 1], 300)
    valid = (idx >= 0) & (idx < v)
    w = random_host(rng, (v, d), "bfloat16")
    grad = random_host(rng, (50000, d), "bfloat16")
    out = cukern.embedding(cupy.asarray(idx), cupy.asarray(w))
    got = to_host(out)
    np.testing.assert_array_equal(got[valid], w[idx[valid]].astype(np.float64))
    np.testing.assert_array_equal(got[~valid], 0.0)
    with pytest.raises(IndexError, match="^indices: "):
        cukern.check_errors()
    dw = cukern.embedding_backward(cupy.asarray(grad), cupy.asarray(idx), v)
    expect = ref.embedding_backward(grad[valid], idx[valid], v)
    tol, scale = grad_tolerance("bfloat16", max_count(idx[valid], v), 1.0, False)
    assert_close(dw, expect, "bfloat16", "dweight", tol=tol, scale=scale)
    with pytest.raises(IndexError, match="^indices: "):
        cukern.check_errors()
    cukern.check_errors()


# ---- streams (GPU) ---------------------------------------------------------------------------

@gpu
@needs_torch
def test_runs_on_torchs_current_stream():
    """The indices are written on a side stream after a long spin; a kernel on any other
    stream would read the old (all-zero) indices."""
    import cupy

    v, d = 3000, 512
    s = torch.cuda.Stream()
    rng = np.random.default_rng(10)
    w = torch.randn(v, d, device="cuda")
    dy = torch.randn(64, 128, d, device="cuda")
    expect_idx = torch.from_numpy(draw_indices(rng, (64, 128), v, "zipf")).cuda()
    idx = torch.zeros(64, 128, dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.stream(s):
        with cupy.cuda.ExternalStream(s.cuda_stream):
            spin()
        idx.copy_(expect_idx)
        y = cukern.embedding(idx, w)
        dw = cukern.embedding_backward(dy, idx, v, padding_idx=1, scale_grad_by_freq=True)
    s.synchronize()
    assert torch.equal(y, torch.nn.functional.embedding(expect_idx, w))
    expect = ref.embedding_backward(to_host(dy), expect_idx.cpu().numpy(), v, 1, True)
    tol, scale = grad_tolerance("float32", max_count(expect_idx.cpu().numpy(), v, 1), 1.0, True)
    assert_close(dw, expect, "float32", "dweight", tol=tol, scale=scale)
    cukern.check_errors()


@gpu
def test_runs_on_cupys_current_stream():
    import cupy

    v, d = 3000, 512
    rng = np.random.default_rng(11)
    w = random_host(rng, (v, d), "float32")
    host_idx = draw_indices(rng, (64, 128), v, "hot", "int32")
    idx = cupy.zeros((64, 128), np.int32)
    new = cupy.asarray(host_idx)
    w_d = cupy.asarray(w)
    cupy.cuda.Device().synchronize()
    s = cupy.cuda.Stream(non_blocking=True)
    with s:
        spin()
        idx[...] = new
        y = cukern.embedding(idx, w_d)
    s.synchronize()
    np.testing.assert_array_equal(to_host(y), ref.embedding(host_idx, w))
    cukern.check_errors()


# ---- bad inputs (GPU: they need device arrays) ---------------------------------------------------

def bad_input_cases(xp):
    """(call, exception, message pattern) of bad arguments (tests/test_bad_inputs.py runs them)."""
    """(call, exception, message pattern) for arrays of module ``xp`` (CuPy, or NumPy standing
    in for device arrays on the CPU; host-array cases only with CuPy)."""
    v, d = 10, 8
    idx = xp.asarray(np.array([[1, 2, 3], [4, 5, 9]], np.int64))
    w = xp.ones((v, d), np.float32)
    grad = xp.ones((2, 3, d), np.float32)
    cases = [
        (lambda: cukern.embedding(idx.astype(np.float32), w), ValueError, "^indices: dtype float32"),
        (lambda: cukern.embedding(idx.astype(np.int16), w), ValueError, "^indices: dtype int16"),
        (lambda: cukern.embedding(idx, xp.ones(v, np.float32)), ValueError, "^weight: "),
        (lambda: cukern.embedding(idx, xp.ones((2, v, d), np.float32)), ValueError, "^weight: "),
        (lambda: cukern.embedding(idx, w.astype(np.float64)), ValueError, "^weight: dtype float64"),
        (lambda: cukern.embedding(idx, w.astype(np.int32)), ValueError, "^weight: dtype int32"),
        (lambda: cukern.embedding(idx, w, padding_idx=v), ValueError, "^padding_idx: "),
        (lambda: cukern.embedding(idx, w, padding_idx=-v - 1), ValueError, "^padding_idx: "),
        (lambda: cukern.embedding(idx, np.ones((v, d), np.float32)), TypeError, "^weight: a host"),
        (lambda: cukern.embedding(np.array([1, 2]), w), TypeError, "^indices: a host"),
        (lambda: cukern.embedding_backward(grad[:, :2], idx, v), ValueError, r"^grad: shape"),
        (lambda: cukern.embedding_backward(grad[0], idx, v), ValueError, r"^grad: shape"),
        (lambda: cukern.embedding_backward(grad.reshape(6, d), idx, v), ValueError, r"^grad: shape"),
        (lambda: cukern.embedding_backward(grad.astype(np.float64), idx, v), ValueError, "^grad: dtype"),
        (lambda: cukern.embedding_backward(grad, idx.astype(np.float32), v), ValueError, "^indices: dtype"),
        (lambda: cukern.embedding_backward(grad, idx, 0), ValueError, "^num_embeddings: "),
        (lambda: cukern.embedding_backward(grad, idx, -4), ValueError, "^num_embeddings: "),
        (lambda: cukern.embedding_backward(grad, idx, 2.5), (ValueError, TypeError), "^num_embeddings: "),
        (lambda: cukern.embedding_backward(np.ones((2, 3, d), np.float32), idx, v), TypeError, "^grad: a host"),
        (lambda: cukern.embedding_backward(grad, np.ones((2, 3), np.int64), v), TypeError, "^indices: a host"),
    ]
    if xp is np:  # NumPy arrays stand in for device arrays here
        cases = [c for c in cases if "host" not in c[2]]
    return cases




@gpu
def test_inputs_on_two_devices_are_an_error():
    import cupy

    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs")
    w = cupy.ones((10, 8), np.float32)
    grad = cupy.ones((3, 8), np.float32)
    with cupy.cuda.Device(1):
        idx = cupy.asarray(np.array([1, 2, 3], np.int64))
    with pytest.raises(ValueError, match="^(indices|weight): on CUDA device"):
        cukern.embedding(idx, w)
    with pytest.raises(ValueError, match="^(indices|grad): on CUDA device"):
        cukern.embedding_backward(grad, idx, 10)


# ---- the family's rows in the shared PyTorch-path tests (tests/test_torch_integration.py) ----

def torch_stand_ins() -> dict:
    import torch.nn.functional as F
    from torch_helpers import recompute

    return {"embedding": (lambda i, w, p, s: (F.embedding(i, w, p),),
                          lambda g, i, v, p, s: tuple(recompute(lambda w: F.embedding(i, w, p, scale_grad_by_freq=s),
                                                                (torch.zeros(v, g.shape[-1]),), g)))}


def torch_wiring_calls(which: str, g) -> list:
    import torch.nn.functional as F

    idx = torch.randint(0, 10, (4, 3), generator=g)
    emb = torch.randn(10, 16, generator=g).requires_grad_(which != "x")
    return [("embedding", (idx, emb, 2, True), lambda: F.embedding(idx, emb, 2, scale_grad_by_freq=True), (emb,))]


def opcheck_samples() -> list:
    from torch_helpers import leaf

    ops = torch.ops.cukern
    idx = torch.randint(0, 20, (3, 7), device="cuda")
    return [(ops.embedding.default, (idx, leaf((20, 32), torch.bfloat16, 0), None, False)),
            (ops.embedding.default, (idx, leaf((20, 32), torch.bfloat16, 0), 0, True))]


def torch_native_cases() -> dict:
    """Replays from C++ (tests/test_torch_native.py): the backward's key sort and scratch fill run
    as native steps; int32 and int64 indices, repeated tokens, padding_idx and the frequency
    scale."""
    import cukern.torch as ct
    from torch_helpers import leaf

    def indices(shape, V, dtype, seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        return torch.randint(0, V, shape, generator=g, device="cuda").to(dtype)

    return {
        "embedding": lambda dt: ((indices((6, 37), 50, torch.int64, 1), leaf((50, 72), dt, 2)),
                                 lambda i, w: ct.embedding(i, w)),
        "embedding_int32_padding_freq": lambda dt: ((indices((300,), 40, torch.int32, 3), leaf((40, 256), dt, 4)),
                                                    lambda i, w: ct.embedding(i, w, padding_idx=5,
                                                                              scale_grad_by_freq=True)),
    }
