"""Why no GPU can be used here, in words a user can act on (the CLI's and the tests' reason)."""
from __future__ import annotations

import ctypes

INSTALL_HINT = 'pip install "cukern[cuda13]" (or "cukern[cuda12]"; from a clone ".[cuda13]")'


def driver_loadable() -> bool:
    """Whether the NVIDIA driver's library (libcuda.so.1) loads."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def _cuda_version(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


def gpu_unavailable_reason() -> str | None:
    """None when CuPy sees a CUDA device; else why not: CuPy missing, no driver, a driver older
    than CuPy's CUDA runtime, or no device."""
    try:
        import cupy
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken installation
        return f"CuPy is not installed ({type(e).__name__}: {e}); {INSTALL_HINT}"
    rt = cupy.cuda.runtime
    try:
        n = rt.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - sorted out below
        return _explain(e, rt)
    return None if n > 0 else "no CUDA device (the CUDA runtime reports 0 devices)"


def _explain(error: Exception, rt) -> str:
    text = f"{type(error).__name__}: {error}"
    # (with no driver at all the CUDA runtime says cudaErrorInsufficientDriver too)
    if not driver_loadable():
        return f"no NVIDIA driver (libcuda.so.1 does not load; {text})"
    if "InsufficientDriver" in text:
        try:
            driver, runtime = rt.driverGetVersion(), rt.runtimeGetVersion()
        except Exception:  # noqa: BLE001 - the versions only sharpen the message
            return f"the NVIDIA driver is older than CuPy's CUDA runtime ({text})"
        return (f"the NVIDIA driver supports CUDA {_cuda_version(driver)}, older than CuPy's CUDA runtime "
                f"{_cuda_version(runtime)}: update the driver, or install the CUDA flavour the driver "
                f"supports (nvidia-smi's \"CUDA Version\"; cukern[cuda12] for 12.x)")
    return f"no CUDA device ({text})"
