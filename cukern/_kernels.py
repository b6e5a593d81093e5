"""Locating the CUDA sources, compiling template instances, and caching them per device.

Every family (``norm``, ...) has one source file in ``cuda_src/``. Its local ``#include``
directives are expanded here, so the text handed to NVRTC is self-contained: no include
paths are needed, and CuPy's on-disk cache (keyed by the source text, the options and the
name expressions) is invalidated by a change to any header, not only to the ``.cu`` file.

A kernel is asked for by family source and template instance, e.g.
``function("norm.cu", "norm_fwd<cuk_bf16, false, 8, 4, 128, 128>")``. Each instance is
compiled in a module of its own the first time it is used on a device (a model uses a few
instances; compiling all of them up front would cost a minute), then kept in memory.
"""
from __future__ import annotations

import ctypes
import functools
import os
import re
import struct
import threading
from pathlib import Path

import numpy as np

from ._arrays import DeviceArray

__all__ = ["CompileError", "source_dir", "load_source", "function", "COMPILE_OPTIONS"]

# -std=c++17 for `if constexpr`. CUKERN_EXTRA_NVRTC_OPTIONS (space-separated) adds options
# for experiments, e.g. -DCUK_STREAM_HINTS; they are part of CuPy's cache key.
COMPILE_OPTIONS = ("--std=c++17", *os.environ.get("CUKERN_EXTRA_NVRTC_OPTIONS", "").split())

_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$', re.MULTILINE)


class CompileError(RuntimeError):
    """NVRTC rejected a kernel instance. ``log`` holds NVRTC's log, ``instance`` the name."""

    def __init__(self, instance: str, log: str):
        self.instance = instance
        self.log = log
        super().__init__(f"NVRTC failed to compile {instance}:\n{log}")


def source_dir() -> Path:
    """The ``cuda_src`` directory: inside the installed package, else in the source checkout."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "cuda_src", here.parent / "cuda_src"):
        if (candidate / "common").is_dir():
            return candidate
    raise FileNotFoundError(
        f"cukern's CUDA sources (cuda_src/) were found neither in {here} nor beside it; "
        "the installation is incomplete")


@functools.lru_cache(maxsize=None)
def load_source(name: str) -> str:
    """Text of ``cuda_src/<name>`` with its local includes expanded (each header once)."""
    root = source_dir()
    seen: set[Path] = set()

    def expand(path: Path) -> str:
        path = path.resolve()
        if path in seen:  # every header is `#pragma once`
            return ""
        seen.add(path)
        text = path.read_text()

        def include(m: re.Match) -> str:
            target = path.parent / m.group(1)
            if not target.is_file():
                raise FileNotFoundError(f"{path.name}: included file {m.group(1)} not found")
            return f"// ---- {m.group(1)}\n{expand(target)}\n// ---- end {m.group(1)}"

        return _INCLUDE.sub(include, text).replace("#pragma once", "")

    return expand(root / name)


_cache: dict[tuple[str, str, int], object] = {}
_lock = threading.Lock()


def function(source: str, instance: str, device: int):
    """The compiled ``cupy.RawKernel`` for ``instance`` of ``cuda_src/<source>`` on ``device``."""
    key = (source, instance, device)
    fn = _cache.get(key)
    if fn is not None:
        return fn
    import cupy

    with _lock:
        fn = _cache.get(key)
        if fn is None:
            with cupy.cuda.Device(device):
                try:  # CuPy may compile in the constructor or at the first lookup
                    module = cupy.RawModule(code=load_source(source), options=COMPILE_OPTIONS,
                                            name_expressions=[instance])
                    fn = module.get_function(instance)
                except cupy.cuda.compiler.CompileException as e:
                    raise CompileError(instance, str(e)) from None
            _cache[key] = fn
    return fn


def cached_instances() -> list[tuple[str, str, int]]:
    """(source, instance, device) of every kernel compiled in this process so far."""
    return sorted(_cache)


# ---- launching ----------------------------------------------------------------------------

_sm_counts: dict[int, int] = {}
_occupancy: dict[tuple[int, int, int], int] = {}


def sm_count(device: int) -> int:
    n = _sm_counts.get(device)
    if n is None:
        import cupy

        n = cupy.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"]
        _sm_counts[device] = n
    return n


def resident_blocks(fn, threads: int, device: int) -> int:
    """How many blocks of ``fn`` fit on the whole device at once (the persistent grid size)."""
    key = (id(fn), threads, device)
    n = _occupancy.get(key)
    if n is None:
        import cupy

        with cupy.cuda.Device(device):
            per_sm = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.kernel.ptr, threads, 0)
        n = max(1, per_sm) * sm_count(device)
        _occupancy[key] = n
    return n


_smem_opt_in: dict[int, int] = {}
_fptrs: dict[int, int] = {}

# Kernel arguments are packed into one buffer, laid out as the C parameter list (each value at
# its natural alignment, which struct's native mode gives), and handed to cuLaunchKernel
# through CU_LAUNCH_PARAM_BUFFER_POINTER: no per-argument wrapper objects, which is most of
# the host time of a CuPy RawKernel call with 10-40 arguments.
_CODES = {np.int64: "q", np.int32: "i", np.uint64: "Q", np.uint32: "I", np.float32: "f"}
_PARAM_BYTES = 1024
_structs: dict[str, struct.Struct] = {}
_local = threading.local()


def pack_params(args) -> tuple[struct.Struct, list]:
    """(layout, values) of a kernel's arguments: DeviceArray -> its pointer, None -> a null
    pointer, NumPy scalars of the exact C type of the parameter (int64, int32, uint64, uint32,
    float32) -> their value. Anything else is a TypeError (a Python int would have no C type)."""
    codes, values = ["@"], []
    for a in args:
        t = type(a)
        if t is DeviceArray:
            codes.append("Q")
            values.append(a.ptr)
        elif a is None:
            codes.append("Q")
            values.append(0)
        else:
            code = _CODES.get(t)
            if code is None:
                raise TypeError(f"kernel argument {a!r} of type {t.__name__}: pass a DeviceArray, None, or a "
                                "NumPy scalar of the parameter's C type (int64, int32, uint64, uint32, float32)")
            codes.append(code)
            values.append(a)
    fmt = "".join(codes)
    layout = _structs.get(fmt)
    if layout is None:
        layout = _structs[fmt] = struct.Struct(fmt)
        if layout.size > _PARAM_BYTES:
            raise ValueError(f"kernel arguments take {layout.size} bytes; at most {_PARAM_BYTES} are supported")
    return layout, values


def _param_buffer():
    """This thread's parameter buffer and the cuLaunchKernel ``extra`` array pointing at it."""
    st = getattr(_local, "params", None)
    if st is None:
        buf = (ctypes.c_uint64 * (_PARAM_BYTES // 8))()
        size = ctypes.c_size_t(0)
        # CU_LAUNCH_PARAM_BUFFER_POINTER (1), the buffer, CU_LAUNCH_PARAM_BUFFER_SIZE (2), a
        # pointer to its size, CU_LAUNCH_PARAM_END (0)
        extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(buf), 2, ctypes.addressof(size), 0)
        st = _local.params = (buf, size, extra, ctypes.addressof(extra))
    return st


def _dims(d) -> tuple[int, int, int]:
    if isinstance(d, tuple):
        return (tuple(d) + (1, 1))[:3]
    return d, 1, 1


def launch(fn, grid, block, args, shared_mem: int = 0) -> None:
    """Launch on the current CuPy stream: ``grid`` blocks of ``block`` threads (ints or
    tuples) with ``shared_mem`` bytes of dynamic shared memory. ``args``: DeviceArray (its
    pointer), None (a null pointer) or NumPy scalars of the exact C type of the parameter."""
    import cupy

    layout, values = pack_params(args)
    key = id(fn)   # (kernels live as long as _cache: ids stay valid)
    if shared_mem > 48 * 1024 and _smem_opt_in.get(key, 0) < shared_mem:
        if fn.max_dynamic_shared_size_bytes < shared_mem:
            fn.max_dynamic_shared_size_bytes = shared_mem  # the opt-in above the default 48 KB
        _smem_opt_in[key] = shared_mem
    fptr = _fptrs.get(key)
    if fptr is None:
        fptr = _fptrs[key] = fn.kernel.ptr
    buf, size, _, extra = _param_buffer()
    layout.pack_into(buf, 0, *values)
    size.value = layout.size
    gx, gy, gz = _dims(grid)
    bx, by, bz = _dims(block)
    cupy.cuda.driver.launchKernel(fptr, gx, gy, gz, bx, by, bz, shared_mem, cupy.cuda.get_current_stream().ptr,
                                  0, extra)
