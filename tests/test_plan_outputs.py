"""The fronts read their outputs from a plan by name (``Builder.alloc(name=...)``,
``Plan.out``): run on the CPU with a plan whose allocations are NumPy arrays filled with their
own number (no kernel runs), every front returns the buffers of the shapes and dtypes it
promises, each its own allocation, in the order its docstring gives."""
from __future__ import annotations

import numpy as np
import pytest

import cukern


@pytest.fixture
def allocations(host_arrays_as_device, monkeypatch):
    """Plans allocate NumPy arrays (allocation n filled with n) and launch nothing."""
    from cukern import _arrays, _faults, _plans

    def fake_run(self, arrays):
        for slot, fix in self.fixes:
            arrays[slot] = fix(arrays[slot])
        for n, alloc in enumerate(self.allocs):
            if isinstance(alloc, _plans.Absent):
                arrays.append(None)
                continue
            dtype = np.float32 if alloc.dtype.startswith("float8") else _arrays._np_dtype(alloc.dtype)
            arrays.append(_arrays.wrap(np.full(alloc.shape, n, dtype), f"alloc {n}"))
        return arrays

    monkeypatch.setattr(_plans.Plan, "__call__", fake_run)
    monkeypatch.setattr(_faults, "record", lambda device: np.zeros(3, np.int64))


def _h(*shape, dtype=np.float32):
    return np.random.default_rng(0).standard_normal(shape).astype(dtype)


def _own(*arrays) -> list:
    """The number each array was filled with (its allocation's), checking it is filled alike."""
    out = []
    for a in arrays:
        assert a is not None and (a == a.flat[0]).all()
        out.append(int(a.flat[0]))
    assert len(set(out)) == len(out), out   # each its own allocation
    return out


def test_norms(allocations):
    x, r, w, b = _h(8, 64), _h(8, 64), _h(64), _h(64)
    y = cukern.layer_norm(x, w, b)
    assert y.shape == x.shape and y.dtype == x.dtype
    y, h, mean, rstd = cukern.layer_norm(x, w, b, residual=r, return_stats=True)
    assert (y.shape, h.shape, mean.shape, rstd.shape) == (x.shape, x.shape, (8,), (8,))
    assert _own(y, h, mean, rstd) == sorted(_own(y, h, mean, rstd))
    y, rstd = cukern.rms_norm(x, w, return_stats=True)
    assert (y.shape, rstd.shape) == (x.shape, (8,)) and _own(y, rstd)
    dx, dw, db = cukern.layer_norm_backward(x, x, w, _h(8), _h(8))
    assert (dx.shape, dw.shape, db.shape) == (x.shape, (64,), (64,)) and _own(dx, dw, db)
    dx, dw = cukern.rms_norm_backward(x, x, w, _h(8))
    assert (dx.shape, dw.shape) == (x.shape, (64,)) and _own(dx, dw)


def test_group_norm(allocations):
    x, w = _h(2, 8, 4, 4), _h(8)
    y, mean, rstd = cukern.group_norm(x, 2, w, w, return_stats=True)
    assert (y.shape, mean.shape, rstd.shape) == (x.shape, (2, 2), (2, 2)) and _own(y, mean, rstd)
    dx, dw, db = cukern.group_norm_backward(x, x, 2, w, _h(2, 2), _h(2, 2))
    assert (dx.shape, dw.shape, db.shape) == (x.shape, (8,), (8,)) and _own(dx, dw, db)
    dx, dw, db = cukern.group_norm_backward(x, x, 2, None, _h(2, 2), _h(2, 2))
    assert dw is None and (dx.shape, db.shape) == (x.shape, (8,))


def test_embedding_swiglu_rope(allocations):
    idx, w = np.array([[1, 2], [3, 0]], np.int64), _h(5, 16)
    out = cukern.embedding(idx, w)
    assert out.shape == (2, 2, 16) and out.dtype == w.dtype
    dw = cukern.embedding_backward(_h(2, 2, 16), idx, 5)
    assert dw.shape == (5, 16)
    g, u = _h(4, 32, dtype=np.float16), _h(4, 32, dtype=np.float16)
    assert cukern.swiglu(g, u).shape == g.shape
    dg, du = cukern.swiglu_backward(g, g, u)
    assert (dg.shape, du.shape) == (g.shape, g.shape) and _own(dg, du)
    q, k = _h(2, 4, 8, 64, dtype=np.float16), _h(2, 2, 8, 64, dtype=np.float16)   # (B, H, S, D)
    cos = sin = _h(8, 64)
    qo, ko = cukern.rope(q, k, cos, sin)
    assert (qo.shape, ko.shape) == (q.shape, k.shape) and _own(qo, ko)


def test_cross_entropy(allocations):
    logits, target = _h(6, 40), np.array([1, 2, 3, 0, 5, 39], np.int64)
    loss, lse = cukern.cross_entropy(logits, target, reduction="none", return_lse=True)
    assert (loss.shape, lse.shape, lse.dtype) == ((6,), (6,), np.float32)
    loss, dlogits, lse = cukern.cross_entropy_forward_backward(logits, target, return_lse=True)
    assert (loss.shape, dlogits.shape, lse.shape) == ((), logits.shape, (6,)) and _own(loss, dlogits, lse)
    loss, dlogits = cukern.cross_entropy_forward_backward(logits, target, inplace=True)
    assert dlogits is logits
    d = cukern.cross_entropy_backward(np.ones((), np.float32), logits, target, _h(6))
    assert d.shape == logits.shape
