"""The `gpu` marker and the hypothesis profiles shared by every test module.

Tests marked `gpu` are skipped, with the reason shown, where no CUDA device is visible.
hypothesis profiles: `ci` (derandomized, no deadline) and `dev` (random, no deadline, since
the first call of a kernel instance compiles it); choose with HYPOTHESIS_PROFILE.
"""
import functools
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


@functools.lru_cache(maxsize=None)
def gpu_unavailable_reason() -> str | None:
    """None when a CUDA device can be used, else why not."""
    try:
        import cupy
    except ImportError as e:
        return f"CuPy is not installed ({e})"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - no driver, no device: the same answer
        return f"no CUDA device ({type(e).__name__}: {e})"
    return None if n > 0 else "no CUDA device"


def pytest_collection_modifyitems(config, items):
    reason = gpu_unavailable_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"needs a GPU: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def host_arrays_as_device(monkeypatch):
    """Let NumPy arrays pass for device arrays, so that the argument checks, which run before
    any allocation or launch, can be tested without a GPU."""
    from cukern import _arrays

    def fake(obj, name, dtypes=("float32", "float16", "bfloat16")):
        if obj is None:
            raise TypeError(f"{name}: required, got None")
        a = np.asarray(obj)
        arr = _arrays.DeviceArray(a, "cupy", a.ctypes.data, a.shape, [st // a.itemsize for st in a.strides],
                                  a.dtype.name, 0, name)
        if arr.dtype not in dtypes:
            raise ValueError(f"{name}: dtype {arr.dtype} is not supported")
        return arr

    monkeypatch.setattr(_arrays, "as_device_array", fake)
