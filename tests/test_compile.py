"""Every kernel instance compiles under NVRTC for sm_80 and sm_90 with no register spills.

Runs with no GPU: NVRTC is driven directly (``cukern._nvrtc``), with the real sources from
``cuda_src/``, and ptxas's resource report (registers, stack frame, spills) is read from
the program log. Each family is compiled once per architecture per session; the compiles of
all (family, arch) pairs run side by side in threads (ctypes releases the GIL), ~20 s each.
"""
from __future__ import annotations

import concurrent.futures
import functools
import importlib
import os
import re

import pytest

import cukern
from cukern import _kernels, _nvrtc

# Kernel sources by family module: "module" has SOURCE (its file in cuda_src/) and instances()
# (every template instance the front can launch, as name expressions); "module:bwd" names a
# module's second source, BWD_SOURCE with bwd_instances().
FAMILIES = ("cukern.norm", "cukern.group_norm", "cukern.embedding", "cukern._partials", "cukern.attention",
            "cukern.attention:bwd")
ARCHS = ("sm_80", "sm_90")
PAIRS = [(family, arch) for family in FAMILIES for arch in ARCHS]


@functools.lru_cache(maxsize=None)
def nvrtc_missing() -> str | None:
    """None when libnvrtc loads, else why not."""
    try:
        _nvrtc.library()
        _nvrtc.version()
    except OSError as e:
        return str(e)
    return None


@pytest.fixture(scope="module")
def nvrtc():
    reason = nvrtc_missing()
    if reason is not None:
        pytest.skip(f"libnvrtc cannot be loaded: {reason}")
    return _nvrtc


def source_and_instances(family: str) -> tuple[str, list[str]]:
    name, _, part = family.partition(":")
    module = importlib.import_module(name)
    if part:
        return getattr(module, f"{part.upper()}_SOURCE"), getattr(module, f"{part}_instances")()
    return module.SOURCE, module.instances()


def _compile(family: str, arch: str):
    return _nvrtc.compile_instances(*source_and_instances(family), arch)


@pytest.fixture(scope="module")
def reports(nvrtc):
    """{(family, arch): Future of the list of ResourceUsage}; compiled once, in parallel."""
    workers = max(1, min(len(PAIRS), len(os.sched_getaffinity(0))))
    with concurrent.futures.ThreadPoolExecutor(max_workers=workers) as pool:
        futures = {pair: pool.submit(_compile, *pair) for pair in PAIRS}
        yield futures


def _report(reports, family, arch):
    return reports[(family, arch)].result()  # re-raises a CompileError here


def test_nvrtc_loads_in_ci():
    """CI must run the compile check, not skip it: libnvrtc comes from nvidia-cuda-nvrtc-cu12."""
    reason = nvrtc_missing()
    if reason is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI is set but libnvrtc cannot be loaded, so the compile check would be "
                    f"skipped: {reason}")
    pytest.skip(f"libnvrtc cannot be loaded (not CI): {reason}")


@pytest.mark.parametrize("family", FAMILIES)
def test_family_declares_instances(family):
    source, names = source_and_instances(family)
    assert isinstance(source, str) and (_kernels.source_dir() / source).is_file()
    assert names, f"{family}.instances() is empty"
    dupes = sorted({n for n in names if names.count(n) > 1})
    assert not dupes, f"{family}.instances() lists these more than once: {dupes}"


@pytest.mark.parametrize("family, arch", PAIRS)
def test_every_instance_compiles(reports, family, arch):
    """Each requested instance got a ptxas report, and no unrequested kernel did."""
    usages = _report(reports, family, arch)
    requested = set(source_and_instances(family)[1])
    reported = {u.instance for u in usages}
    missing = sorted(requested - reported)
    extra = sorted(reported - requested)
    assert not missing and not extra, (
        f"{family} for {arch}: {len(missing)} requested instance(s) without a ptxas report "
        f"{missing[:10]}; {len(extra)} reported but not requested {extra[:10]}")
    assert all(u.arch == arch for u in usages)


@pytest.mark.parametrize("family, arch", PAIRS)
def test_no_spills(reports, family, arch):
    """ptxas reports 0 bytes of stack frame, spill stores and spill loads for every instance."""
    usages = _report(reports, family, arch)
    offenders = [u for u in usages if u.spill_stores or u.spill_loads or u.stack_frame]
    assert not offenders, f"{family} for {arch}: {len(offenders)} instance(s) spill:\n" + "\n".join(
        f"  {u.instance}: {u.registers} registers, {u.stack_frame} B stack frame, "
        f"{u.spill_stores} B spill stores, {u.spill_loads} B spill loads" for u in offenders)


def test_unknown_instance_raises_compile_error(nvrtc):
    name = "norm_fwd<does_not_exist>"
    with pytest.raises(cukern.CompileError) as excinfo:
        nvrtc.compile_instances("norm.cu", [name], "sm_80")
    err = excinfo.value
    assert isinstance(err, RuntimeError)
    assert err.log.strip(), "CompileError.log should carry NVRTC's log"
    assert "error" in err.log
    assert name in str(err), f"the message should name the instance {name!r}:\n{err}"


def test_broken_source_raises_compile_error(nvrtc, monkeypatch):
    """A syntax error in the source: CompileError with NVRTC's log pointing at it."""
    broken = "template <int N> __global__ void k(float* p) { p[0] = N }\n"
    monkeypatch.setattr(_kernels, "load_source", lambda name: broken)
    with pytest.raises(cukern.CompileError) as excinfo:
        nvrtc.compile_instances("broken.cu", ["k<1>"], "sm_80")
    err = excinfo.value
    assert "error" in err.log, err.log
    assert "broken.cu" in str(err)


@pytest.mark.parametrize("family", FAMILIES)
def test_source_is_self_contained(family):
    """The text handed to NVRTC has its local includes expanded: no include paths needed."""
    text = _kernels.load_source(source_and_instances(family)[0])
    left = [line for line in text.splitlines() if re.match(r'\s*#\s*include\s+"', line)]
    assert not left, f"unexpanded includes: {left}"


def test_load_source_expands_common_headers():
    text = _kernels.load_source("norm.cu")
    assert '#include "' not in text
    header = (_kernels.source_dir() / "common" / "dtype.cuh").read_text()
    assert header.replace("#pragma once", "") in text


@pytest.mark.gpu
def test_runtime_compile_error_carries_the_log_and_the_instance():
    """The path that runs kernels (CuPy RawModule) reports a failing instance the same way."""
    bad = "norm_fwd<cuk_bf16, true, 8, 4, 128, 128, 1, does_not_exist>"
    with pytest.raises(cukern.CompileError) as info:
        _kernels.function("norm.cu", bad, 0)
    assert info.value.instance == bad
    assert info.value.log.strip()
    assert bad in str(info.value)
