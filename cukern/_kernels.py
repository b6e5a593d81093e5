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

import functools
import os
import re
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
_NULL = np.uint64(0)


def launch(fn, grid, block, args, shared_mem: int = 0) -> None:
    """Launch on the current CuPy stream: ``grid`` blocks of ``block`` threads (ints or
    tuples) with ``shared_mem`` bytes of dynamic shared memory. ``args``: DeviceArray (its
    pointer), None (a null pointer) or NumPy scalars of the exact C type of the parameter."""
    converted = []
    for a in args:
        if a is None:
            converted.append(_NULL)
        elif type(a) is DeviceArray:
            converted.append(np.uint64(a.ptr))
        else:
            converted.append(a)
    if shared_mem > 48 * 1024 and _smem_opt_in.get(id(fn), 0) < shared_mem:
        if fn.max_dynamic_shared_size_bytes < shared_mem:
            fn.max_dynamic_shared_size_bytes = shared_mem  # the opt-in above the default 48 KB
        _smem_opt_in[id(fn)] = shared_mem   # (kernels live as long as _cache: ids stay valid)
    fn(grid if isinstance(grid, tuple) else (grid,), block if isinstance(block, tuple) else (block,),
       tuple(converted), shared_mem=shared_mem)
