"""Every kernel instance compiles under NVRTC for sm_80 and sm_90 with no register spills, and
every instance's declared signature and shared-memory size agree with its family's config.

Runs with no GPU: NVRTC is driven directly (``cukern._nvrtc``), with the real sources from
``cuda_src/``, and ptxas's resource report (registers, stack frame, spills) is read from the
program log. The kernels come from the families themselves (``cukern._registry``): a new
family is checked without touching this file. Each (family, source) is compiled once per
architecture per session; the compiles run side by side in worker processes (NVRTC 13.5
serializes the programs that threads of one process compile: two took 1.75 times one).
The kernels that take dynamic shared memory check the size their config computes against
their own with a static_assert, so a disagreement fails the compile.

The whole-tree compile (marker ``compile``) is most of a CPU run: ``-m "not compile"`` leaves it out.
"""
from __future__ import annotations

import collections
import concurrent.futures
import functools
import multiprocessing
import os
import re
import struct
import sys
import threading
import time

import pytest

import cukern
from cukern import _kernels, _nvrtc, _registry, _sources

ARCHS = ("sm_80", "sm_90")


def _units() -> list[tuple[str, str]]:
    """(kernel module, source) of every source a family or shared module launches."""
    out = []
    for name, instances in _registry.kernel_modules():
        for source in sorted({i.source for i in instances()}):
            out.append((name, source))
    return out


def instances_of(module: str, source: str, arch: str | None = None) -> list:
    """The instances of ``source`` (those ``arch`` builds: an instance built for one architecture
    alone, Instance.arch, only for that one)."""
    fn = dict(_registry.kernel_modules())[module]
    return [i for i in fn() if i.source == source and (arch is None or i.arch in (None, arch))]


def _archs(module: str, source: str) -> tuple[str, ...]:
    """sm_80 and sm_90, or the architectures the source's instances are built for alone (sm_90a)."""
    own = {i.arch for i in instances_of(module, source) if i.arch}
    return tuple(sorted(own)) if own else ARCHS


UNITS = _units()
PAIRS = [(module, source, arch) for module, source in UNITS for arch in _archs(module, source)]


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


class _Reports:
    """The compile futures, and a line of progress while a test waits on one: the first test
    waits minutes for its program, and a run that prints nothing that long looks hung. The line
    is written from the main thread with pytest's capture suspended (a write from the pool's
    thread would land in the captured output)."""

    WAIT_S = 30

    def __init__(self, futures: dict, config):
        self.futures, self.config = futures, config
        self.t0, self.done, self.lock = time.monotonic(), [0], threading.Lock()
        for f in futures.values():
            f.add_done_callback(self._count)

    def _count(self, _future) -> None:
        with self.lock:
            self.done[0] += 1

    def _say(self, line: str) -> None:
        writer = self.config.pluginmanager.get_plugin("terminalreporter")
        capture = self.config.pluginmanager.get_plugin("capturemanager")
        # (a pytest-xdist worker has no terminal reporter; its stderr reaches the terminal)
        write = writer.write_line if writer is not None else lambda s: print(s, file=sys.stderr, flush=True)
        if capture is None:
            write(line)
            return
        with capture.global_and_fixture_disabled():
            write(line)

    def result(self, key):
        future = self.futures[key]
        while True:
            try:
                return future.result(timeout=self.WAIT_S)  # re-raises a CompileError here
            except concurrent.futures.TimeoutError:
                self._say(f"[compile check] {self.done[0]}/{len(self.futures)} programs compiled "
                          f"by NVRTC ({time.monotonic() - self.t0:.0f} s)")


@pytest.fixture(scope="module")
def reports(nvrtc, pytestconfig):
    """The compiled Program of each (module, source, arch); compiled once, in parallel (spawned
    workers: they import cukern afresh, whatever threads this process runs)."""
    workers = max(1, min(len(PAIRS), len(os.sched_getaffinity(0))))
    context = multiprocessing.get_context("spawn")
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        futures = {(module, source, arch): pool.submit(_nvrtc.compile_program, source,
                                                       [i.name for i in instances_of(module, source, arch)], arch)
                   for module, source, arch in PAIRS}
        yield _Reports(futures, pytestconfig)


def _report(reports, module, source, arch):
    return reports.result((module, source, arch)).usages


def test_nvrtc_loads_in_ci():
    """CI must run the compile check, not skip it: libnvrtc comes with the cuda12/cuda13 extras."""
    reason = nvrtc_missing()
    if reason is None:
        return
    if os.environ.get("CI"):
        pytest.fail(f"CI is set but libnvrtc cannot be loaded, so the compile check would be skipped: {reason}")
    pytest.skip(f"libnvrtc cannot be loaded (not CI): {reason}")


def test_every_family_declares_kernels():
    names = [name for name, _ in _registry.kernel_modules()]
    assert set(_registry.FAMILIES) <= set(names)
    for name, fn in _registry.kernel_modules():
        insts = fn()
        assert insts, f"{name} declares no kernel instances"
        dupes = sorted(n for n, c in collections.Counter(i.name for i in insts).items() if c > 1)
        assert not dupes, f"{name} lists these more than once: {dupes}"
        for i in insts:
            assert (_kernels.source_dir() / i.source).is_file(), i.source
            assert i.threads > 0 and i.threads % 32 == 0 and i.smem >= 0, i


@pytest.mark.parametrize("module, source", UNITS)
def test_every_instance_has_a_declared_signature(module, source):
    """The parameter list of every instance is read from its source, template types resolved:
    the launches are packed against it by name (see test_kernel_arguments_*)."""
    for inst in instances_of(module, source):
        sig = _kernels.signature(inst)
        assert sig.names and len(sig.names) == len(sig.codes) == len(sig.dtypes), inst.name
        assert all(c == "P" or d is None for c, d in zip(sig.codes, sig.dtypes))


@pytest.mark.compile
@pytest.mark.parametrize("module, source, arch", PAIRS)
def test_every_instance_compiles(reports, module, source, arch):
    """Each requested instance got a ptxas report, and no unrequested kernel did."""
    usages = _report(reports, module, source, arch)
    requested = {i.name for i in instances_of(module, source, arch)}
    reported = {u.instance for u in usages}
    missing, extra = sorted(requested - reported), sorted(reported - requested)
    assert not missing and not extra, (
        f"{source} for {arch}: {len(missing)} requested instance(s) without a ptxas report "
        f"{missing[:10]}; {len(extra)} reported but not requested {extra[:10]}")
    assert all(u.arch == arch for u in usages)


@pytest.mark.compile
@pytest.mark.parametrize("module, source, arch", PAIRS)
def test_no_spills(reports, module, source, arch):
    """ptxas reports 0 bytes of stack frame, spill stores and spill loads for every instance."""
    usages = _report(reports, module, source, arch)
    offenders = [u for u in usages if u.spill_stores or u.spill_loads or u.stack_frame]
    assert not offenders, f"{source} for {arch}: {len(offenders)} instance(s) spill:\n" + "\n".join(
        f"  {u.instance}: {u.registers} registers, {u.stack_frame} B stack frame, "
        f"{u.spill_stores} B spill stores, {u.spill_loads} B spill loads" for u in offenders)


@pytest.mark.compile
@pytest.mark.parametrize("module, source, arch", PAIRS)
def test_no_performance_warnings(reports, module, source, arch):
    """ptxas reports no C75xx warning: wgmma serialized (C7515, C7511: accumulators touched
    between its fence and its wait, or registers short), setmaxnreg ignored (C7508), ..."""
    _report(reports, module, source, arch)
    warnings = reports.result((module, source, arch)).warnings
    assert not warnings, f"{source} for {arch}:\n" + "\n".join(warnings)


@pytest.mark.compile
def test_two_blocks_an_sm_fit_the_hopper_forwards_shared_memory(reports):
    """Sm90FwdConfig.static_smem, which the two-blocks-an-SM check adds to the dynamic size, is
    at least what ptxas reports for every shipped Hopper forward (a block that does not fit
    beside another runs alone, at half the speed, with no error)."""
    import importlib

    attention = importlib.import_module("cukern.attention")   # (cukern.attention is the function)
    configs = attention.configs.CONFIGS
    usages = {u.instance: u for u in _report(reports, "attention", "attention_fwd_sm90.cu", "sm_90a")}
    tables = configs.fwd_sm90 + configs.fwd_sm90_full + configs.fwd_sm90_varlen
    checked = 0
    for d, cfg in tables:
        for mask in (0, 1, 2):
            for varlen in ((False, True) if not cfg.persistent else (False,)):
                name = cfg.instance("bfloat16", d, mask, varlen=varlen, dv=configs.dv(d)).name
                if name in usages:
                    assert usages[name].shared_bytes <= cfg.static_smem, (name, usages[name].shared_bytes)
                    checked += 1
    assert checked >= len(tables)


def test_a_compile_error_crosses_a_process_boundary_whole():
    """The check's workers hand a CompileError back pickled: its instance and log survive."""
    import pickle

    e = _kernels.CompileError("k<1>", "the log")
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is _kernels.CompileError
    assert (back.instance, back.log, str(back)) == (e.instance, e.log, str(e))


def test_sm90a_instances_are_checked_for_sm90a_alone():
    """The Hopper primitives' instances are built (and checked) for sm_90a only; the rest for
    sm_80 and sm_90."""
    pairs = {(source, arch) for _, source, arch in PAIRS}
    assert ("hopper_check.cu", "sm_90a") in pairs
    assert not {("hopper_check.cu", a) for a in ARCHS} & pairs
    assert ("norm.cu", "sm_80") in pairs and ("norm.cu", "sm_90a") not in pairs


@pytest.mark.compile
def test_a_wrong_shared_memory_size_fails_the_compile(nvrtc):
    """The static_assert that holds Python's shared-memory size to the kernel's own."""
    import importlib

    attention = importlib.import_module("cukern.attention")   # (cukern.attention is the function)
    inst = attention.configs.CONFIGS.get("fwd", 64).instance("bfloat16", 64, False)
    wrong = re.sub(r", (\d+)>$", lambda m: f", {int(m.group(1)) + 16}>", inst.name)
    with pytest.raises(cukern.CompileError) as info:
        nvrtc.compile_instances(inst.source, [wrong], "sm_80")
    assert "shared" in info.value.log.lower() or "static assertion" in info.value.log.lower(), info.value.log


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
    monkeypatch.setattr(_sources, "load_source", lambda name: broken)
    with pytest.raises(cukern.CompileError) as excinfo:
        nvrtc.compile_instances("broken.cu", ["k<1>"], "sm_80")
    err = excinfo.value
    assert "error" in err.log, err.log
    assert "broken.cu" in str(err)


@pytest.mark.parametrize("source", sorted({s for _, s in UNITS}))
def test_source_is_self_contained(source):
    """The text handed to NVRTC has its local includes expanded: no include paths needed."""
    text = _kernels.load_source(source)
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
    bad = "norm_fwd<cuk::bf16, true, 8, 4, 128, 128, 1, 1, false, 0, does_not_exist>"
    with pytest.raises(cukern.CompileError) as info:
        _kernels.function("norm.cu", bad, 0)
    assert info.value.instance == bad
    assert info.value.log.strip()
    assert bad in str(info.value)


def _field_paths(source: str, decl, prefix: str = ""):
    """The member designators of a struct's fields in declaration order, nested structs walked
    (the order the signature flattens them in)."""
    from cukern import _signatures

    for f in decl.fields:
        inner = None if f.pointer else _signatures.struct_declaration(source, f.ctype)
        if inner is not None:
            yield from _field_paths(source, inner, f"{prefix}{f.name}.")
        else:
            yield prefix + f.name


@pytest.mark.compile
@pytest.mark.parametrize("module, source", [u for u in UNITS if u[1].startswith("attention")])
def test_struct_parameters_are_packed_at_the_compilers_layout(nvrtc, monkeypatch, module, source):
    """Each field of a struct a kernel takes by value sits where the packed buffer puts it, and
    the struct's size is what the packer allows for: static_asserts of the compiler's offsetof
    and sizeof against the signature's offsets, compiled with the source."""
    from cukern import _signatures

    if nvrtc.version() < (13, 0):   # (the layout is the C ABI's whatever compiles it)
        pytest.skip(f"NVRTC {nvrtc.version()} has no offsetof (13.0 has __builtin_offsetof)")
    checks, seen = [], set()
    for inst in instances_of(module, source):
        decl = _signatures.declarations(source)[inst.kernel_name]
        if inst.kernel_name in seen:
            continue
        seen.add(inst.kernel_name)
        sig = _kernels.signature(inst)
        types = {name: arg for (kind, name), arg in zip(decl.template, inst.template_args) if kind == "typename"}
        for i, p in enumerate(decl.params):
            sd = None if p.pointer else _signatures.struct_declaration(source, p.ctype)
            if sd is None:
                continue
            ctype = f"{p.ctype}<{', '.join(types.get(a, a) for a in p.targs)}>" if p.targs else p.ctype
            start = sig.param_offsets[i]
            end = sig.param_offsets[i + 1] if i + 1 < len(decl.params) else struct.calcsize(sig.format)
            for j, path in enumerate(_field_paths(source, sd)):
                assert sig.names[sig.params[i] + j] == path.rsplit(".", 1)[-1]
                at = sig.offsets[sig.params[i] + j] - start
                checks.append(f'static_assert(__builtin_offsetof({ctype}, {path}) == {at}, "{ctype}::{path}");')
            checks.append(f'static_assert(sizeof({ctype}) == {end - start}, "sizeof {ctype}");')
    assert checks, f"{source}: no kernel takes a struct"
    text = "\n".join([_sources.load_source(source), *checks, "template <int N> __global__ void layout_probe() {}\n"])
    monkeypatch.setattr(_sources, "load_source", lambda name: text)
    arch = "sm_90a" if "sm90" in source else "sm_80"
    nvrtc.compile_instances(source, ["layout_probe<0>"], arch)
