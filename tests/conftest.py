"""The `gpu` marker and the hypothesis profiles shared by every test module.

Tests marked `gpu` are skipped, with the reason shown once for all of them, where no CUDA
device is visible.
hypothesis profiles: `ci` (derandomized, no deadline) and `dev` (random, no deadline, since
the first call of a kernel instance compiles it); choose with HYPOTHESIS_PROFILE.
A run of the whole suite uses every core (up to 8) through pytest-xdist where it is installed
(by file, or test by test where the compile check is deselected), each worker with its share of
the cores' OpenMP threads;
`-n 0` (or `-p no:xdist`) keeps one process, as a run of single files or tests does.
"""
import functools
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from fakes import DryRun, FakeKernel  # noqa: F401 - test modules import them from here

settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))

# The tests of cukern.torch's native path expect it from an op's first call: its extension is
# built (or loaded) then, not in the background as in a user's process.
os.environ.setdefault("CUKERN_NATIVE", "wait")


MAX_WORKERS = 8   # (each worker holds a CUDA context where there is a GPU)


def _whole_suite(config) -> bool:
    here = os.path.dirname(os.path.abspath(__file__))
    args = [os.path.abspath(str(a).split("::")[0]) for a in (config.args or ["tests"])]
    return all(a in (here, os.path.dirname(here)) for a in args) and not any("::" in str(a) for a in config.args)


def _compile_deselected(markexpr: str | None) -> bool:
    return bool(markexpr) and markexpr.replace(" ", "") in ("notcompile", "notcompileandnotgpu", "notgpuandnotcompile")


@pytest.hookimpl(tryfirst=True)   # (before xdist's own, which turns -n into workers)
def pytest_cmdline_main(config):
    # A run of the whole suite spreads over the cores; a run of files or single tests stays in one
    # process, which starts sooner.
    o = config.option
    if not config.pluginmanager.hasplugin("xdist") or hasattr(config, "workerinput"):
        return
    if (o.numprocesses is None and _whole_suite(config) and not o.usepdb and not o.collectonly
            and o.capture != "no"):
        o.numprocesses = min(len(os.sched_getaffinity(0)), MAX_WORKERS)
        if o.numprocesses < 2:
            o.numprocesses = None
        elif o.dist == "no":
            # by file where the compile check runs: its module fixture compiles every program,
            # once in one worker (with -n given, the default split by test: pass --dist loadfile
            # with it); without it, test by test to whichever worker is free (the files' times
            # differ tenfold, so a split by file leaves one worker idle)
            o.dist = "worksteal" if _compile_deselected(o.markexpr) else "loadfile"
    cores = len(os.sched_getaffinity(0))
    workers = (o.numprocesses if isinstance(o.numprocesses, int)
               else cores if o.numprocesses in ("auto", "logical") else 0)
    if workers >= 2:
        # the workers share the cores: with OpenMP's and OpenBLAS's default of a thread a core in
        # every worker, their spinning threads take turns on the same cores (twice the CPU time,
        # slower than one process on two cores); the workers inherit this
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // workers)))


@functools.lru_cache(maxsize=None)
def gpu_unavailable_reason() -> str | None:
    """None when a CUDA device can be used, else why not (no CuPy, no driver, a driver too old)."""
    from cukern._environment import gpu_unavailable_reason as reason

    return reason()


COLLECTED: dict[str, int] = {}   # the whole collection, before -m and -k deselect (test_readme_figures)


@pytest.hookimpl(tryfirst=True)   # (before the -m / -k deselection)
def pytest_collection_modifyitems(config, items):
    if _whole_suite(config):   # (the whole suite was collected)
        COLLECTED["total"] = len(items)
        COLLECTED["gpu"] = sum(1 for i in items if i.get_closest_marker("gpu") is not None)


@pytest.hookimpl(tryfirst=True)   # (before the skipif marks: every GPU test skips with this one)
def pytest_runtest_setup(item):
    # A skip raised here, not a skip mark (reported at each test's own line), has one location and
    # reason for all GPU tests, so `-ra` prints one line for them, "SKIPPED [N] tests/conftest.py:..."
    if "gpu" in item.keywords:
        reason = gpu_unavailable_reason()
        if reason is not None:
            pytest.skip(f"needs a GPU: {reason}")


@pytest.fixture
def host_arrays_as_device(monkeypatch):
    """Let NumPy arrays pass for device arrays and stop every call where its launch plan would
    run (``DryRun``, holding the plan): the argument checks and the plan building, kernel
    arguments packed against the kernels' declared signatures included, run without a GPU."""
    from cukern import _arrays, _kernels, _plans

    def fake(obj, name, dtypes=_arrays.FLOATS):
        if obj is None:
            raise TypeError(f"{name}: required, got None")
        if not isinstance(obj, np.ndarray):   # scalars, strings, lists: as the real check
            raise _arrays._not_an_array(obj, name)
        arr = _arrays.wrap(obj, name)
        arr.device = 0
        if arr.dtype not in dtypes:   # (the real check's message)
            raise ValueError(f"{name}: dtype {arr.dtype} is not supported (expected one of {', '.join(dtypes)})")
        return arr

    def dry(self, arrays):
        raise DryRun(self)

    monkeypatch.setattr(_arrays, "as_device_array", fake)
    monkeypatch.setattr(_kernels, "kernel", FakeKernel)
    monkeypatch.setattr(_kernels, "sm_count", lambda device: 132)
    # (an A100's paths unless a test says otherwise: tests of the Hopper paths set (9, 0))
    monkeypatch.setattr(_kernels, "compute_capability", lambda device: (8, 0))
    monkeypatch.setattr(_kernels, "max_shared_memory", lambda device: 166912)   # (an A100's opt-in)
    monkeypatch.setattr(_plans.Plan, "__call__", dry)
