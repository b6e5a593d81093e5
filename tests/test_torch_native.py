"""cukern.torch's native eager path (cukern/torch/_native.py, _native.cpp): a call signature's
launch plans recorded on its first call and replayed from C++ under a C++ autograd node.

On the CPU (CI): the extension builds against the installed PyTorch and tells call signatures
apart. On a GPU: replayed calls give the Python path's bits, forward and backward, and
actually run natively (the extension's hit count); gradients in another layout, saved inputs
changed in place, threads with no CUDA context, and signatures it must decline."""
from __future__ import annotations

import itertools
import shutil

import pytest

torch = pytest.importorskip("torch")

import cukern.torch as ct  # noqa: E402
from cukern.torch import _native, _native_build, _tools  # noqa: E402

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA build of torch and a GPU")
needs_compiler = pytest.mark.skipif(shutil.which("c++") is None or shutil.which("ninja") is None,
                                    reason="building the extension needs a C++ compiler and ninja")


@pytest.fixture(autouse=True)
def _route_every_size(monkeypatch):
    for name in _tools.MIN_SIZE:
        monkeypatch.setitem(_tools.MIN_SIZE, name, 0)
    yield


@pytest.fixture(scope="module")
def ext():
    """The extension on the CPU, not bound to a driver: the build in cukern's cache, made once
    for this source and this PyTorch (built into a fresh directory, it was rebuilt on every run:
    most of a CPU run without the compile check)."""
    return _native_build.ensure(retry=True)


# ---- CPU: the build and the call signature ----------------------------------------------------

@needs_compiler
def test_the_extension_builds_and_tells_call_signatures_apart(ext):
    x = torch.randn(6, 8)
    base = (x, None, 1e-5)
    key = ext.key(3, base, False)
    assert key == ext.key(3, (torch.randn(6, 8), None, 1e-5), False)   # another address, same signature
    others = [
        ext.key(4, base, False),                                   # another op
        ext.key(3, base, True),                                    # recording a graph
        ext.key(3, (x.to(torch.bfloat16), None, 1e-5), False),     # dtype
        ext.key(3, (torch.randn(6, 9), None, 1e-5), False),        # shape
        ext.key(3, (torch.randn(8, 6).t(), None, 1e-5), False),    # strides
        ext.key(3, (torch.randn(49)[1:].view(6, 8), None, 1e-5), False),   # 16-byte alignment
        ext.key(3, (x, torch.randn(8), 1e-5), False),              # an optional tensor given
        ext.key(3, (x, None, 1e-6), False),                        # a float's value
        ext.key(3, (x, None, 1), False),                           # a float and an int
        ext.key(3, (x, None, True), False),                        # an int and a bool
        ext.key(3, (x, "mean", 1e-5), False),                      # a string
        ext.key(3, (x, "mean_", 1e-5), False),
        ext.key(3, (x, "sum", 1e-5), False),
        ext.key(3, (x, "none", 1e-5), False),
    ]
    torch.use_deterministic_algorithms(True)
    try:
        others.append(ext.key(3, base, False))                    # torch.use_deterministic_algorithms
    finally:
        torch.use_deterministic_algorithms(False)
    assert all(k != key for k in others) and len({tuple(k) for k in others}) == len(others)
    assert ext.key(3, (x, b"bytes"), False) is None                # an argument it cannot key


@needs_compiler
def test_an_unknown_signature_misses_and_a_declined_one_says_so(ext):
    x = torch.randn(5, 7)
    assert ext.call(11, (x, None, 0.5)) is None
    ext.decline(ext.key(11, (x, None, 0.5), False))
    assert ext.call(11, (x, None, 0.5)) is False
    assert ext.call(11, (x, None, 0.25)) is None
    assert ext.layout(torch.randn(3, 4).t()) == ([4, 3], [1, 4], 6)   # (6: at::ScalarType::Float)


@needs_compiler
def test_plans_with_fills_are_taken_and_bad_steps_refused(ext):
    """A plan's steps besides launches: fills of buffers; anything else (a sort, which no plan
    has any more), or a buffer outside the plan, is refused when added."""
    x = torch.randn(5, 7)
    key = ext.key(99, (x,), False)   # (an op number no other test runs)
    keys = ext.layout(torch.empty(4, dtype=torch.int64))

    def add(steps):
        return ext.add(key, 0, [0], (1, [keys], steps), [[1, 0]], [1], 1, [], None, [], [-1], [])

    assert add([("fill", [1], 0.0), ("fill", [0, 1], 0.0)])
    for bad in ([("sort", [1], 0.0)], [("fill", [2], 0.0)], [("fill", [-1], 0.0)], [("shuffle", [1], 0.0)]):
        with pytest.raises(RuntimeError, match="cukern native path"):
            add(bad)


# ---- GPU: replays against the Python path -------------------------------------------------------

def _leaf(shape, dtype, seed, scale=1.0, channels_last=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = (torch.randn(shape, generator=g, device="cuda") * scale).to(dtype)
    if channels_last:
        t = t.to(memory_format=torch.channels_last)
    return t.requires_grad_(True)


CASES = {
    "layer_norm": lambda dt: ((_leaf((4, 50, 96), dt, 0), (96,), _leaf((96,), dt, 1), _leaf((96,), dt, 2), 1e-5),
                              lambda x, s, w, b, e: ct.layer_norm(x, s, w, b, e)),
    "layer_norm_no_bias": lambda dt: ((_leaf((3, 200), dt, 0), (200,), _leaf((200,), dt, 1), None, 1e-5),
                                      lambda x, s, w, b, e: ct.layer_norm(x, s, w, b, e)),
    "layer_norm_2d_shape": lambda dt: ((_leaf((4, 6, 8, 12), dt, 0), (8, 12), _leaf((8, 12), dt, 1), None, 1e-5),
                                       lambda x, s, w, b, e: ct.layer_norm(x, s, w, b, e)),
    "rms_norm": lambda dt: ((_leaf((4, 50, 96), dt, 0, 0.01), (96,), _leaf((96,), dt, 1)),
                            lambda x, s, w: ct.rms_norm(x, s, w)),
    "rms_norm_no_weight": lambda dt: ((_leaf((7, 1000), dt, 0), (1000,), None),
                                      lambda x, s, w: ct.rms_norm(x, s, w)),
    "group_norm": lambda dt: ((_leaf((3, 16, 7, 5), dt, 0), 4, _leaf((16,), dt, 1), _leaf((16,), dt, 2)),
                              lambda x, g, w, b: ct.group_norm(x, g, w, b)),
    "group_norm_channels_last": lambda dt: ((_leaf((3, 16, 7, 5), dt, 0, channels_last=True), 4,
                                             _leaf((16,), dt, 1), None),
                                            lambda x, g, w, b: ct.group_norm(x, g, w, b)),
    # (the eager backward scales the forward's gradient in place: a gradient that is a saved buffer)
    "cross_entropy": lambda dt: ((_leaf((64, 1000), dt, 0, 3.0), _target(64, 1000)),
                                 lambda x, t: ct.cross_entropy(x, t, label_smoothing=0.1)),
    "cross_entropy_none": lambda dt: ((_leaf((33, 517), dt, 0, 3.0), _target(33, 517)),
                                      lambda x, t: ct.cross_entropy(x, t, ignore_index=3, reduction="none")),
    # (on Hopper: launches with TMA tensor maps, encoded per call; bits repeat in deterministic mode)
    "sdpa_causal": lambda dt: (tuple(_leaf((2, 4, 130, 128), _half(dt), s) for s in range(3)),
                               lambda q, k, v: ct.scaled_dot_product_attention(q, k, v, is_causal=True)),
    "sdpa_gqa_d64": lambda dt: ((_leaf((1, 8, 200, 64), _half(dt), 0), _leaf((1, 2, 200, 64), _half(dt), 1),
                                 _leaf((1, 2, 200, 64), _half(dt), 2)),
                                lambda q, k, v: ct.scaled_dot_product_attention(q, k, v, enable_gqa=True)),
    # (packed documents, one empty and one of a token, GQA: the offsets are a tensor argument
    # read on the device, the longest document an int of the signature. flash_attn_func's calls
    # ask for the deterministic backward: its deterministic=False is not the global mode's, and
    # dq's float32 atomic sums then vary in their last bits from run to run)
    "attention_varlen": lambda dt: ((_leaf((258, 4, 64), _half(dt), 0), _leaf((258, 2, 64), _half(dt), 1),
                                     _leaf((258, 2, 64), _half(dt), 2), _offsets([37, 130, 1, 0, 90]),
                                     _offsets([37, 130, 1, 0, 90]), 130, 130),
                                    lambda q, k, v, cq, ck, mq, mk: ct.flash_attn_varlen_func(q, k, v, cq, ck, mq, mk,
                                                                                              causal=True,
                                                                                              deterministic=True)),
    # (attention sinks: a float32 (H,) input with its own gradient, dense with a window and packed)
    "attention_sink": lambda dt: ((_leaf((2, 150, 4, 128), _half(dt), 0), _leaf((2, 150, 2, 128), _half(dt), 1),
                                   _leaf((2, 150, 2, 128), _half(dt), 2), _leaf((4,), torch.float32, 3)),
                                  lambda q, k, v, s: ct.flash_attn_func(q, k, v, causal=True, window_size=(64, 0),
                                                                        learnable_sink=s, deterministic=True)),
    "attention_varlen_sink": lambda dt: ((_leaf((258, 4, 64), _half(dt), 0), _leaf((258, 2, 64), _half(dt), 1),
                                          _leaf((258, 2, 64), _half(dt), 2), _offsets([37, 130, 1, 0, 90]),
                                          _offsets([37, 130, 1, 0, 90]), 130, 130, _leaf((4,), torch.float32, 3)),
                                         lambda q, k, v, cq, ck, mq, mk, s: ct.flash_attn_varlen_func(
                                             q, k, v, cq, ck, mq, mk, causal=True, learnable_sink=s,
                                             deterministic=True)),
    # (dropout: its draw a (2,) int64 input made each call from the generator, reseeded so that
    # every call drops the same weights)
    "attention_dropout": lambda dt: ((_leaf((2, 150, 4, 64), _half(dt), 0), _leaf((2, 150, 2, 64), _half(dt), 1),
                                      _leaf((2, 150, 2, 64), _half(dt), 2)),
                                     lambda q, k, v: (torch.cuda.manual_seed(5),
                                                      ct.flash_attn_func(q, k, v, dropout_p=0.2, causal=True,
                                                                         deterministic=True))[1]),
    "attention_varlen_dropout": lambda dt: ((_leaf((258, 4, 64), _half(dt), 0), _leaf((258, 2, 64), _half(dt), 1),
                                             _leaf((258, 2, 64), _half(dt), 2), _offsets([37, 130, 1, 0, 90]),
                                             _offsets([37, 130, 1, 0, 90]), 130, 130),
                                            lambda q, k, v, cq, ck, mq, mk: (torch.cuda.manual_seed(5),
                                                                              ct.flash_attn_varlen_func(
                                                                                  q, k, v, cq, ck, mq, mk,
                                                                                  dropout_p=0.2, causal=True,
                                                                                  deterministic=True))[1]),
}


def _offsets(lengths):
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device="cuda")


def _half(dt):
    return torch.float16 if dt == torch.float32 else dt


def _family_cases() -> dict:
    """A family's own cases: ``torch_native_cases()`` in its test module, {name: (dtype ->
    (inputs, call))}, each name starting with its op's name (a new family adds its rows there)."""
    from torch_helpers import family_tables

    return {k: v for table in family_tables("torch_native_cases") for k, v in table.items()}


CASES.update(_family_cases())


def _op_of(case: str) -> str:
    return "attention" if case.startswith("sdpa") else next(
        (op for op in sorted(_native_ops(), key=len, reverse=True) if case.startswith(op)), "?")


def _native_ops() -> list:
    from cukern._registry import families

    return [spec.name for f in families() for spec in f.torch_ops if spec.native]


def test_every_native_op_has_replay_cases():
    """An op declared native is replayed from C++ on a GPU: its replays must be checked against
    its Python path here (a case named after the op, here or in its family's test module)."""
    covered = {_op_of(c) for c in CASES}
    assert set(_native_ops()) <= covered, f"native ops without a case: {set(_native_ops()) - covered}"


def _target(rows, classes):
    return torch.randint(0, classes, (rows,), generator=torch.Generator(device="cuda").manual_seed(5), device="cuda")


def _run(call, inputs, dy_layout=None):
    """(output, gradients of the inputs that need one) with a fixed random upstream gradient."""
    out = call(*inputs)
    # (in the output's layout, as the layer after it would give it: channels-last for channels-last)
    dy = torch.empty_like(out).copy_(torch.randn(out.shape, generator=torch.Generator(device="cuda").manual_seed(7),
                                                 device="cuda", dtype=out.dtype))
    if dy_layout == "transposed":   # the same values, another layout
        dy = dy.transpose(0, 1).contiguous().transpose(0, 1)
    elif dy_layout == "gaps":       # the same values, every other element of a wider buffer
        dy = dy.new_empty(*dy.shape[:-1], 2 * dy.shape[-1])[..., ::2].copy_(dy)
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    return out, torch.autograd.grad(out, leaves, dy)


def _python_path(monkeypatch, fn):
    with monkeypatch.context() as m:
        m.setenv("CUKERN_NATIVE", "0")
        return fn()


def _equal(a, b):
    (out_a, grads_a), (out_b, grads_b) = a, b
    assert torch.equal(out_a, out_b) and out_a.stride() == out_b.stride()
    assert len(grads_a) == len(grads_b)
    for x, y in zip(grads_a, grads_b):
        assert torch.equal(x, y) and x.stride() == y.stride()


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(CASES))
def test_replayed_calls_give_the_python_paths_bits(case, dtype, monkeypatch):
    deterministic = case.startswith(("sdpa", "attention"))   # (attention's dq: no atomics, so bits repeat)
    torch.use_deterministic_algorithms(deterministic)
    try:
        _replays_match(case, dtype, monkeypatch)
    finally:
        torch.use_deterministic_algorithms(False)


def _replays_match(case, dtype, monkeypatch):
    inputs, call = CASES[case](dtype)
    expect = _python_path(monkeypatch, lambda: _run(call, inputs))
    ext = _native.wait()
    assert ext is not None, "the native path did not build"
    _equal(_run(call, inputs), expect)        # the first call: the Python path, recorded
    before = ext.hits()
    for _ in range(2):
        _equal(_run(call, inputs), expect)    # replayed from C++
    assert ext.hits() == before + 2
    # no gradient: the forward alone, replayed too
    with torch.no_grad():
        plain = _python_path(monkeypatch, lambda: call(*inputs))
        call(*inputs)
        before = ext.hits()
        again = call(*inputs)
    assert ext.hits() == before + 1 and torch.equal(again, plain)


@gpu
@needs_cuda
def test_a_gradient_in_another_layout_is_read_right(monkeypatch):
    inputs, call = CASES["layer_norm"](torch.bfloat16)
    expect = _python_path(monkeypatch, lambda: _run(call, inputs))
    ext = _native.wait()
    _run(call, inputs)                                   # recorded with a contiguous gradient
    before = ext.hits()
    _equal(_run(call, inputs, dy_layout="transposed"), expect)
    assert ext.hits() == before + 1


@gpu
@needs_cuda
def test_a_first_gradient_with_gaps_leaves_the_signature_to_later_calls(monkeypatch):
    """A backward the recorder cannot take because of that call's gradient is retried by later
    calls, and the signature declined only after RECORD_TRIES such calls (under pytest-xdist, a
    test elsewhere that met a signature first with such a gradient kept this file's replays off)."""
    ext = _native.wait()
    call = lambda x, w: ct.rms_norm(x, (40,), w)   # (a shape no other test uses)
    inputs = (_leaf((5, 3, 40), torch.bfloat16, 0), _leaf((40,), torch.bfloat16, 1))
    expect = _python_path(monkeypatch, lambda: _run(call, inputs))
    _equal(_run(call, inputs, dy_layout="gaps"), expect)     # recorded, its backward not taken
    assert ext.call(_op_index("rms_norm"), (*inputs, _tools.FLOAT32_EPS, 0.0, 0)) is None   # not declined
    _equal(_run(call, inputs), expect)                       # recorded again, and taken
    before = ext.hits()
    _equal(_run(call, inputs, dy_layout="gaps"), expect)     # replayed: the gradient made dense in C++
    assert ext.hits() == before + 1
    # a signature whose every backward has a gradient with gaps is declined after RECORD_TRIES
    inputs = (_leaf((5, 3, 48), torch.bfloat16, 0), _leaf((48,), torch.bfloat16, 1))
    call = lambda x, w: ct.rms_norm(x, (48,), w)
    for _ in range(_native.RECORD_TRIES):
        assert ext.call(_op_index("rms_norm"), (*inputs, _tools.FLOAT32_EPS, 0.0, 0)) is None
        _run(call, inputs, dy_layout="gaps")
    assert ext.call(_op_index("rms_norm"), (*inputs, _tools.FLOAT32_EPS, 0.0, 0)) is False


@gpu
@needs_cuda
def test_a_saved_input_changed_in_place_is_an_error():
    inputs, call = CASES["rms_norm"](torch.float32)
    x, s, w = inputs
    for _ in range(2):
        _run(call, inputs)
    ext = _native.wait()
    before = ext.hits()
    xc = x.detach().clone().requires_grad_(True)
    h = xc * 1.0
    y = call(h, s, w)
    assert ext.hits() == before + 1
    with torch.no_grad():
        h.add_(1.0)           # the version counter of the saved input moves
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@gpu
@needs_cuda
def test_replays_run_on_a_thread_that_has_made_no_cuda_call():
    from torch_helpers import in_fresh_thread

    inputs, call = CASES["rms_norm"](torch.bfloat16)
    expect = _run(call, inputs)
    _run(call, inputs)   # (registered)
    torch.cuda.synchronize()
    _equal(in_fresh_thread(lambda: _run(call, inputs)), expect)


@gpu
@needs_cuda
def test_ops_that_are_not_native_and_declined_signatures_keep_the_python_path(monkeypatch):
    ext = _native.wait()
    h = _leaf((24, 64), torch.bfloat16, 0)
    w = _leaf((100, 64), torch.bfloat16, 1)
    before = ext.hits()
    for _ in range(3):   # linear cross-entropy is not declared native (several plans): never replayed
        ct.linear_cross_entropy(h, w, _target(24, 100)).backward()
    # a strided input the norm copies first: declined, then the Python path every time
    x = _leaf((8, 2, 96), torch.bfloat16, 3)
    wx = _leaf((96,), torch.bfloat16, 4)
    xs = x[:, 0]   # rows 2*96 apart: read in place, no copy ...
    xt = x.transpose(0, 1)   # (2, 8, 96): not one uniform row stride, copied
    expect = _python_path(monkeypatch, lambda: _run(lambda a: ct.rms_norm(a, (96,), wx), (xt,)))
    for _ in range(3):
        _equal(_run(lambda a: ct.rms_norm(a, (96,), wx), (xt,)), expect)
    assert ext.call(_op_index("rms_norm"), (xt, wx, _tools.FLOAT32_EPS, 0.0, 0)) is False
    assert ext.hits() == before
    for _ in range(2):
        _run(lambda a: ct.rms_norm(a, (96,), wx), (xs,))
    assert ext.hits() == before + 1


def _op_index(name):
    from cukern.torch._ops import OPS

    return OPS[name].index
