"""Test helpers shared by the families: random inputs in either framework, comparison with a
dtype-aware tolerance, allocator poisoning, and a kernel that keeps a stream busy."""
from __future__ import annotations

import numpy as np

try:
    import ml_dtypes
except ImportError:  # the references still run in float32/float16
    ml_dtypes = None

try:
    import torch
except ImportError:
    torch = None

FLOAT_DTYPES = ("float32", "float16", "bfloat16")
# Relative tolerance per output dtype: the rounding of the output dominates.
TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}


def np_dtype(name: str):
    return ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)


def random_host(rng: np.random.Generator, shape, dtype: str, scale=1.0, offset=0.0):
    """Random normal values rounded to ``dtype`` (a NumPy array of that dtype). Never zeros,
    and never subnormal: CuPy compiles with flush-to-zero."""
    a = rng.standard_normal(shape).astype(np.float32) * np.float32(scale) + np.float32(offset)
    a[np.abs(a) < 1e-3] = 1e-3
    return a.astype(np_dtype(dtype))


def to_device(host: np.ndarray, framework: str):
    """A device copy of ``host`` (any dtype, bfloat16 included) as a CuPy array or torch tensor."""
    if framework == "torch":
        t = torch.from_numpy(host.astype(np.float32).copy(order="C"))  # keeps 0-d arrays 0-d
        dt = {"float32": torch.float32, "float16": torch.float16,
              "bfloat16": torch.bfloat16}.get(host.dtype.name)
        return t.to(device="cuda", dtype=dt) if dt is not None else t.cuda()
    import cupy

    return cupy.asarray(host)


def ints_to_device(host: np.ndarray, framework: str):
    """A device copy of an integer array in its own dtype (``to_device`` is for floats)."""
    if framework == "torch":
        return torch.from_numpy(np.ascontiguousarray(host)).cuda()
    import cupy

    return cupy.asarray(host)


def to_host(a) -> np.ndarray:
    """float64 NumPy copy of a CuPy array or torch tensor."""
    if torch is not None and isinstance(a, torch.Tensor):
        return a.detach().float().cpu().numpy().astype(np.float64)
    import cupy

    return cupy.asnumpy(a).astype(np.float64)


def assert_close(out, ref, dtype: str, name: str, tol: float | None = None, scale: float = 0.0):
    """Relative L2 error and an element-wise bound |out-ref| <= tol*(|ref| + rms(ref)). NaN fails.

    ``scale``: the magnitude of the terms the result was computed from, where the result can
    be far smaller than they are (a difference that cancels); errors are measured against it.
    """
    tol = TOL[dtype] if tol is None else tol
    out = to_host(out) if not isinstance(out, np.ndarray) else out.astype(np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert out.shape == ref.shape, f"{name}: shape {out.shape} != reference {ref.shape}"
    assert not np.isnan(out).any(), f"{name}: NaN in the output (unwritten element?)"
    if ref.size == 0:
        return
    rms = float(np.sqrt(np.mean(ref * ref)))
    err = np.abs(out - ref)
    l2 = float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), scale * np.sqrt(ref.size), 1e-30))
    assert l2 <= tol, f"{name}: relative L2 error {l2:.3g} > {tol:g}"
    bound = tol * (np.abs(ref) + rms + scale) + 1e-30
    bad = err > bound
    if bad.any():
        i = np.unravel_index(np.argmax(err / bound), err.shape)
        raise AssertionError(f"{name}: {int(bad.sum())} of {err.size} elements off; worst at {i}: "
                             f"{out[i]!r} vs reference {ref[i]!r} (dtype {dtype}, tol {tol:g})")


def raise_as_expected(cases) -> None:
    """Each (call, exception type, message pattern) raises that exception with that message."""
    import pytest

    for call, exc, pattern in cases:
        with pytest.raises(exc, match=pattern):
            call()


def poison_allocator(framework: str, nbytes_list) -> None:
    """Fill blocks of the given sizes with NaN and free them, so that the caching allocator
    hands NaN-filled memory to the next allocations of those sizes (an unwritten output
    element then shows up as NaN)."""
    if framework == "torch":
        blocks = [torch.full((max(n, 4) // 4,), float("nan"), device="cuda") for n in nbytes_list]
    else:
        import cupy

        blocks = [cupy.full((max(n, 4) // 4,), np.nan, dtype=np.float32) for n in nbytes_list]
    del blocks


_SPIN = r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""


def spin(cycles: int = 50_000_000) -> None:
    """Keep the current CuPy stream busy for ``cycles`` GPU clocks (about 25 ms at 2 GHz)."""
    import cupy

    kernel = cupy.RawKernel(_SPIN, "spin")
    kernel((1,), (1,), (np.int64(cycles),))
