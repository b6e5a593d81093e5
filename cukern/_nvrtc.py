"""Direct NVRTC calls (through ctypes) that compile kernel instances with no GPU present.

CuPy's compile entry points ask the driver for the current device, so they fail on a machine
with no GPU; NVRTC itself does not need one. This module drives it directly to compile every
kernel instance for a named architecture and to read ptxas's resource report (registers,
spills) from the program log. It is used by the compile-check test and by
``python -m cukern info``; the kernels that run are compiled by CuPy (see ``_kernels``), except
those built for one architecture's own features (sm_90a: wgmma), whose cubin comes from here.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import json
import re
import threading
from dataclasses import dataclass

from . import _sources

__all__ = ["library", "version", "compile_instances", "compile_program", "cached_program", "Program",
           "ResourceUsage"]


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL:
    """libnvrtc, found through cuda-pathfinder (pip wheels, CUDA_PATH) or the loader path."""
    errors = []
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib

        return ctypes.CDLL(load_nvidia_dynamic_lib("nvrtc").abs_path)
    except Exception as e:  # noqa: BLE001 - fall through to the system loader
        errors.append(f"cuda.pathfinder: {e}")
    for name in (ctypes.util.find_library("nvrtc"), "libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"):
        if not name:
            continue
        try:
            return ctypes.CDLL(name)
        except OSError as e:
            errors.append(f"{name}: {e}")
    raise OSError("libnvrtc not found (it comes with cukern's CUDA extras: pip install \".[cuda13]\" or "
                  "\".[cuda12]\", i.e. CuPy's [ctk]): " + "; ".join(errors))


def version() -> tuple[int, int]:
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(library().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


def _check(status: int, what: str, log: str = "") -> None:
    if status != 0:
        lib = library()
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        msg = lib.nvrtcGetErrorString(status).decode()
        raise _sources.CompileError(what, f"{msg}\n{log}".strip())


@dataclass(frozen=True)
class ResourceUsage:
    """ptxas's report for one kernel instance on one architecture."""
    instance: str
    arch: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_frame: int
    shared_bytes: int


_FUNC = re.compile(r"Compiling entry function '([^']+)' for '(sm_\d+a?)'")
_STACK = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


# One reporting compile at a time: with NVRTC 13, concurrent compiles in one process were seen
# to lose ptxas's -v report from their logs (every instance unreported, both programs). Compiles
# that only want the cubin (cached_program) run concurrently.
_report_lock = threading.Lock()


@dataclass(frozen=True)
class Program:
    """One compiled NVRTC program: ptxas's report per instance, its performance warnings
    (C75xx: e.g. wgmma serialized), the cubin, and each instance's lowered (mangled) name."""
    usages: list
    warnings: tuple[str, ...]
    cubin: bytes
    lowered: dict


# ptxas's performance warnings: wgmma serialized (C7515, C7511), setmaxnreg ignored (C7508), ...
_PERF_WARNING = re.compile(r"\(C75\d\d\)")


def compile_instances(source: str, instances: list[str], arch: str = "sm_90",
                      extra_options: tuple[str, ...] = ()) -> list[ResourceUsage]:
    """Compile ``instances`` of ``cuda_src/<source>`` for ``arch`` in one NVRTC program.

    Returns ptxas's resource report per instance; raises CompileError with NVRTC's log on
    failure. The options are the ones CuPy uses at run time, plus ptxas's verbose report.
    """
    return compile_program(source, instances, arch, extra_options).usages


def compile_program(source: str, instances: list[str], arch: str = "sm_90",
                    extra_options: tuple[str, ...] = (), report: bool = True) -> Program:
    """``compile_instances``, with the cubin, the lowered names and ptxas's C75xx warnings
    (``report=False``: no ptxas report, usages and warnings empty, and no wait for another
    thread's compile)."""
    if not report:
        return _compile_instances(source, instances, arch, extra_options, report=False)
    with _report_lock:
        return _compile_instances(source, instances, arch, extra_options)


def cached_program(source: str, instances: list[str], arch: str) -> tuple[bytes, dict]:
    """(cubin, {instance: lowered name}) of ``instances`` of ``cuda_src/<source>`` for ``arch``,
    from cukern's cache (``_cache``), else compiled and kept there. The compile runs under a
    lock, so processes starting at once compile it once: the others wait, then read it."""
    from . import _cache

    k = _cache.key(version(), _sources.load_source(source), list(instances), arch, _sources.COMPILE_OPTIONS)
    folder = _cache.directory() / "cubin"
    hit = _read_cached(folder, k)
    if hit is not None:
        return hit
    with _cache.lock(_cache.directory() / "locks" / f"{k}.lock"):
        hit = _read_cached(folder, k)
        if hit is not None:
            return hit
        program = compile_program(source, instances, arch, report=False)
        try:   # (the names first: a cubin on disk means its names are there)
            _cache.write_atomic(folder / f"{k}.json", json.dumps(program.lowered).encode())
            _cache.write_atomic(folder / f"{k}.cubin", program.cubin)
        except OSError:   # (a cache that cannot be written: compiled again next time)
            pass
    return program.cubin, program.lowered


def _read_cached(folder, k: str) -> tuple[bytes, dict] | None:
    try:
        cubin = (folder / f"{k}.cubin").read_bytes()
        names = json.loads((folder / f"{k}.json").read_text())
    except (OSError, ValueError):
        return None
    return (cubin, names) if cubin and isinstance(names, dict) else None


def _compile_instances(source, instances, arch, extra_options, report: bool = True) -> Program:
    lib = library()
    src = _sources.load_source(source).encode()
    prog = ctypes.c_void_p()
    _check(lib.nvrtcCreateProgram(ctypes.byref(prog), src, source.encode(), 0, None, None),
           "nvrtcCreateProgram")
    try:
        for inst in instances:
            _check(lib.nvrtcAddNameExpression(prog, inst.encode()), f"name expression {inst}")
        opts = [*_sources.COMPILE_OPTIONS, "-ftz=true", f"-arch={arch}",
                *(("--ptxas-options=-v",) if report else ()), *extra_options]
        c_opts = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        status = lib.nvrtcCompileProgram(prog, len(opts), c_opts)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, buf)
        log = buf.value.decode(errors="replace")
        _check(status, f"{source} for {arch} ({len(instances)} instances)", log)
        lowered, names = {}, {}
        for inst in instances:
            name = ctypes.c_char_p()
            _check(lib.nvrtcGetLoweredName(prog, inst.encode(), ctypes.byref(name)), inst)
            lowered[name.value.decode()] = inst
            names[inst] = name.value.decode()
        cubin_size = ctypes.c_size_t()
        _check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(cubin_size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(cubin_size.value)
        if cubin_size.value:
            _check(lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
    warnings = tuple(line.strip() for line in log.splitlines() if _PERF_WARNING.search(line))
    return Program(_parse_report(log, lowered, arch), warnings, cubin.raw, names)


def _parse_report(log: str, lowered: dict[str, str], arch: str) -> list[ResourceUsage]:
    usages, current, stack = [], None, None
    for line in log.splitlines():
        m = _FUNC.search(line)
        if m:
            current, stack = m.group(1), None
            continue
        m = _STACK.search(line)
        if m and current:
            stack = tuple(int(g) for g in m.groups())
            continue
        m = _USED.search(line)
        if m and current and stack is not None:
            usages.append(ResourceUsage(lowered.get(current, current), arch, int(m.group(1)),
                                        stack[1], stack[2], stack[0], int(m.group(2) or 0)))
            current = None
    return usages
