"""What a user is told about this machine: the version, a GPU too old, no driver, a driver too old."""
import subprocess
import sys
import types

import pytest

from cukern import _environment, _kernels
from cukern._version import __version__


def test_version_flag():
    r = subprocess.run([sys.executable, "-m", "cukern", "--version"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == f"cukern {__version__}"


@pytest.mark.parametrize("cc", [(7, 5), (7, 0), (6, 1)])
def test_an_older_gpu_is_refused_before_any_compile(monkeypatch, cc):
    monkeypatch.setattr(_kernels, "compute_capability", lambda device: cc)
    monkeypatch.setattr(_kernels, "_functions", {})
    match = rf"compute capability 8\.0 or newer.*has {cc[0]}\.{cc[1]}"
    with pytest.raises(_kernels.UnsupportedDeviceError, match=match):
        _kernels.function("norm.cu", "never_compiled<float>", 0)


@pytest.mark.parametrize("cc", [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0)])
def test_newer_gpus_pass_the_check(monkeypatch, cc):
    monkeypatch.setattr(_kernels, "compute_capability", lambda device: cc)
    _kernels.check_capability(0)


class _RuntimeError(Exception):
    pass


def _fake_cupy(monkeypatch, count=None, error=None, driver=12040, runtime=13000):
    def get_count():
        if error is not None:
            raise _RuntimeError(error)
        return count

    rt = types.SimpleNamespace(getDeviceCount=get_count, driverGetVersion=lambda: driver,
                               runtimeGetVersion=lambda: runtime)
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=types.SimpleNamespace(runtime=rt)))


def test_no_driver_is_named(monkeypatch):
    _fake_cupy(monkeypatch, error="cudaErrorInsufficientDriver: CUDA driver version is insufficient")
    monkeypatch.setattr(_environment, "driver_loadable", lambda: False)
    reason = _environment.gpu_unavailable_reason()
    assert reason.startswith("no NVIDIA driver (libcuda.so.1 does not load")


def test_a_driver_older_than_the_runtime_is_named(monkeypatch):
    _fake_cupy(monkeypatch, error="cudaErrorInsufficientDriver: CUDA driver version is insufficient")
    monkeypatch.setattr(_environment, "driver_loadable", lambda: True)
    reason = _environment.gpu_unavailable_reason()
    assert "supports CUDA 12.4, older than CuPy's CUDA runtime 13.0" in reason and "cuda12" in reason


def test_no_device_and_a_device(monkeypatch):
    _fake_cupy(monkeypatch, count=0)
    assert "0 devices" in _environment.gpu_unavailable_reason()
    _fake_cupy(monkeypatch, count=1)
    assert _environment.gpu_unavailable_reason() is None


def test_without_cupy_the_install_line_is_given(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)   # (import raises ImportError)
    reason = _environment.gpu_unavailable_reason()
    assert reason.startswith("CuPy is not installed") and 'cukern[cuda13]' in reason


def test_this_machine_gets_a_reason_or_none():
    reason = _environment.gpu_unavailable_reason()
    assert reason is None or "InsufficientDriver" not in reason.split("(")[0]
