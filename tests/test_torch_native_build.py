"""The C++ extension's build off the first step's path (cukern/torch/_native_build.py): started in
a process of its own, never waited for by default, one build for processes starting at once, a
failure reported once and not retried."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")

from cukern import _cache  # noqa: E402
from cukern.torch import _native, _native_build  # noqa: E402

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA build of torch and a GPU")
needs_compiler = pytest.mark.skipif(shutil.which("c++") is None or shutil.which("ninja") is None,
                                    reason="building the extension needs a C++ compiler and ninja")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty cache and a process that has not looked at the extension yet (restored after)."""
    monkeypatch.setenv("CUKERN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CUKERN_NATIVE", "1")
    saved = (_native._module, _native._builder, _native._next_look)
    _native._module, _native._builder, _native._next_look = None, None, 0.0
    yield tmp_path / "cache"
    if _native._builder is not None and _native._builder.poll() is None:
        _native._builder.kill()
        _native._builder.wait()
    _native._module, _native._builder, _native._next_look = saved


def _look_again() -> None:
    _native._next_look = 0.0


def test_the_folder_is_in_the_cache_and_keyed_by_source_and_torch(fresh):
    where = _native_build.folder()
    assert where.parent == fresh / "torch-ext"
    assert _native_build.state(where) == "absent"


def test_a_build_that_cannot_run_is_reported_once_and_not_retried(fresh, monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    assert _native.module() is None            # the first call does not wait: the build started
    assert _native._builder is not None and _native.enabled()
    assert _native._builder.wait(timeout=120) == 1
    where = _native_build.folder()
    assert _native_build.state(where) == "failed" and "no C++ compiler" in _native_build.failure(where)
    assert "no C++ compiler" in (where / "build.log").read_text()
    _look_again()
    with pytest.warns(RuntimeWarning, match="no C.. compiler.*not retried"):
        assert _native.module() is None
    assert not _native.enabled()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _native.module() is None        # once
    # a later process: the recorded failure, no warning, no new build
    _native._module, _native._builder = None, None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _native.module() is None
    assert _native._builder is None and not _native.enabled()
    # an explicit retry tries again (and fails again, for the same reason)
    with pytest.raises(_native_build.BuildFailed, match="no C.. compiler"):
        _native_build.ensure(where, retry=True)


def test_a_build_another_process_runs_is_not_started_twice(fresh):
    where = _native_build.folder()
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                               "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)\n"
                               "fcntl.flock(fd, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(60)",
                               str(where / "build.lock")], stdout=subprocess.PIPE, text=True)
    try:
        where.mkdir(parents=True, exist_ok=True)
        assert holder.stdout.readline().strip() == "held"
        assert _native_build.state(where) == "building"
        assert _native_build.start(where) is None
        assert _native.module() is None and _native._builder is None   # waits for the other one
        assert _native.enabled()
    finally:
        holder.kill()
        holder.wait()


def test_a_lock_is_exclusive_across_processes(tmp_path):
    path = tmp_path / "x.lock"
    with _cache.lock(path):
        out = subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; from cukern import _cache;"
                              "print(_cache.held(Path(sys.argv[1])))", str(path)],
                             capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=os.getcwd()))
        assert out.stdout.strip() == "True", out.stderr
    assert not _cache.held(path)


def test_write_atomic_leaves_no_partial_file(tmp_path):
    target = tmp_path / "a" / "b.bin"
    _cache.write_atomic(target, b"x" * 1000)
    assert target.read_bytes() == b"x" * 1000
    assert [p.name for p in target.parent.iterdir()] == ["b.bin"]


@gpu
@needs_cuda
def test_calls_take_the_python_path_until_the_build_is_done_then_switch(fresh):
    """(The build the first call starts runs here in full: the native path's other tests load
    the build in the default cache.)"""
    from cukern.torch._ops import OPS

    x = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(256, device="cuda", dtype=torch.bfloat16)
    want = OPS["rms_norm"](x, w, 1e-6, 0.0, 1)
    assert _native._module is _native._PENDING and _native._builder is not None
    assert _native_build.state(_native_build.folder()) == "building"
    assert _native.wait() is not None                   # waits for the build the first call started
    assert _native_build.state(_native_build.folder()) == "built"
    ext = _native.module()
    before = ext.hits()
    for _ in range(3):
        torch.testing.assert_close(OPS["rms_norm"](x, w, 1e-6, 0.0, 1), want, rtol=0, atol=0)
    assert ext.hits() == before + 2                      # recorded once, then replayed
