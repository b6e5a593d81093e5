"""Kernel sources, compiling, declared signatures and launches: the device side every family uses.

* Sources: every family has one ``.cu`` file in ``cuda_src/``; its local ``#include`` lines are
  expanded here, so the text handed to NVRTC is self-contained (no include paths), and CuPy's
  on-disk cache, keyed by that text, notices a change to any header.
* Instances (``cukern._signatures``: :class:`Instance`, and the declared signatures read from
  the sources): each is compiled the first time it is used on a device, in a module of its
  own, then kept (a model uses a few instances; compiling all takes a minute).
* Arguments are packed against the declared C types, by parameter name (a struct taken by
  value, by field name, at its C layout): a missing or unknown name, a pointer of the wrong
  element type, or a value out of its C type's range is an error, never a shifted argument list.
* Launches: :meth:`Kernel.prepare` resolves the arguments once (constants packed, array
  arguments left as slots filled in per call); :class:`Launch` then packs the per-call pointers
  into one C parameter buffer and calls ``cuLaunchKernel`` on the caller's stream.
"""
from __future__ import annotations

import atexit
import ctypes
import os
import queue
import struct
import threading
import time
from concurrent.futures import Future

import numpy as np

from . import _cache, _sources

# (re-exported: the families name their instances through here)
from ._signatures import TENSOR_MAP, Declaration, Instance, Param, Signature, declarations, signature  # noqa: F401

# (re-exported; the compiles call _sources.load_source, the one place a tool swaps the text)
from ._sources import COMPILE_OPTIONS, CompileError, load_source, source_dir  # noqa: F401

__all__ = ["CompileError", "Instance", "Slot", "MapSlot", "Kernel", "Launch", "source_dir", "load_source", "kernel",
           "signature", "sm_count", "compute_capability", "check_capability", "UnsupportedDeviceError",
           "MIN_CAPABILITY", "COMPILE_OPTIONS"]

# ---- compiling -------------------------------------------------------------------------------

_functions: dict[tuple[str, str, int], object] = {}
_compiling: dict[tuple[str, str, int], Future] = {}
_lock = threading.Lock()


def function(source: str, instance: str, device: int, arch: str | None = None):
    """The compiled ``cupy.RawKernel`` for ``instance`` of ``cuda_src/<source>`` on ``device``
    (built for ``arch`` when given: see ``Instance.arch``). Different instances compile at once
    on different threads (NVRTC releases the GIL); a thread asking for one that another is
    compiling waits for that compile."""
    key = (source, instance, device)
    fn = _functions.get(key)
    if fn is not None:
        return fn
    check_capability(device)
    with _lock:
        fn = _functions.get(key)
        if fn is not None:
            return fn
        pending = _compiling.get(key)
        if pending is None:
            mine = _compiling[key] = Future()
    if pending is not None:
        return pending.result()
    try:
        fn = _arch_function(source, instance, arch, device) if arch is not None else _cupy_function(
            source, instance, device)
    except BaseException as e:
        with _lock:
            del _compiling[key]   # (a later call tries again)
        mine.set_exception(e)
        raise
    with _lock:
        _functions[key] = fn
        del _compiling[key]
    mine.set_result(fn)
    return fn


def _cupy_function(source: str, instance: str, device: int):
    import cupy

    code = _sources.load_source(source)
    # (under a lock a kernel: processes starting at once on an empty cache compile it once; the
    # others wait, then find it in CuPy's cache)
    with _cache.lock(_cache.directory() / "locks" / (_cache.key(
            code, instance, COMPILE_OPTIONS, compute_capability(device)) + ".lock")), cupy.cuda.Device(device):
        try:  # CuPy may compile in the constructor or at the first lookup
            module = cupy.RawModule(code=code, options=COMPILE_OPTIONS, name_expressions=[instance])
            return module.get_function(instance)
        except cupy.cuda.compiler.CompileException as e:
            raise CompileError(instance, str(e)) from None


def in_background(fn, *args) -> None:
    """Run ``fn(*args)`` on a background thread (a few daemon threads, started on first use),
    its exceptions dropped: work ahead of need, e.g. compiling the kernels a backward will use
    while the forward runs. Whatever it fails at fails again, with its error, where it is needed.
    At exit, work not started is dropped and work under way is waited for (``_drain``): a
    process never ends inside a compile."""
    global _background
    if _background is None:
        with _lock:
            if _background is None:
                _background = queue.SimpleQueue()
                for i in range(_BACKGROUND_THREADS):
                    threading.Thread(target=_background_worker, name=f"cukern-background-{i}", daemon=True).start()
                atexit.register(_drain)
    _background.put((fn, args))


# (an NVRTC compile holds a few hundred MB of host memory while it runs: a few at a time)
_BACKGROUND_THREADS = max(1, min(4, (os.cpu_count() or 1) - 1))
_background = None
_busy = threading.Semaphore(_BACKGROUND_THREADS)   # (a worker holds one while it runs a task)
_stopping = threading.Event()


def _background_worker() -> None:
    while True:
        fn, args = _background.get()
        with _busy:
            if _stopping.is_set():   # (looked at under the semaphore: _drain holds them all)
                continue
            try:
                fn(*args)
            except BaseException:  # noqa: BLE001 - see in_background
                pass


def _drain(timeout: float = 60.0) -> bool:
    """Drop the background work not started and wait up to ``timeout`` s for the work under way
    (True when none is left)."""
    _stopping.set()
    end = time.monotonic() + timeout
    taken = 0
    try:
        for _ in range(_BACKGROUND_THREADS):
            if not _busy.acquire(timeout=max(0.0, end - time.monotonic())):
                return False
            taken += 1
        return True
    finally:
        for _ in range(taken):
            _busy.release()


class _ArchFunction:
    """A kernel from a cubin that NVRTC built for one architecture's own features (CuPy builds
    for the device's plain architecture): what Kernel needs of a RawKernel."""

    def __init__(self, loaded):
        self.kernel = loaded   # (.ptr: the CUfunction; it keeps its module loaded)

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        from . import _driver

        return _driver.max_dynamic_shared(self.kernel.ptr)

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value: int) -> None:
        from . import _driver

        _driver.set_max_dynamic_shared(self.kernel.ptr, int(value))


def _arch_function(source: str, instance: str, arch: str, device: int) -> "_ArchFunction":
    import cupy

    from . import _driver, _nvrtc

    major, minor = compute_capability(device)
    if arch != f"sm_{major}{minor}a":
        raise RuntimeError(f"{instance} is built for {arch} alone; device {device} is sm_{major}{minor}")
    cubin, lowered = _nvrtc.cached_program(source, [instance], arch)
    with cupy.cuda.Device(device):
        cupy.cuda.runtime.free(0)   # (the device's primary context made current: the cubin loads into it)
        return _ArchFunction(_driver.load_function(cubin, lowered[instance]))


def cached_instances() -> list[tuple[str, str, int]]:
    """(source, instance, device) of every kernel compiled in this process so far."""
    return sorted(_functions)


# ---- launching -------------------------------------------------------------------------------

_sm_counts: dict[int, int] = {}
_smem_optin: dict[int, int] = {}
_capabilities: dict[int, tuple[int, int]] = {}


def compute_capability(device: int) -> tuple[int, int]:
    """(major, minor) of ``device``: which code paths it can run (clusters: 9.0 and newer)."""
    cc = _capabilities.get(device)
    if cc is None:
        import cupy

        p = cupy.cuda.runtime.getDeviceProperties(device)
        cc = _capabilities[device] = (int(p["major"]), int(p["minor"]))
    return cc


# The oldest GPUs the kernels are written for: bf16 tensor-core mma, cp.async and 164 KB (or
# 99 KB) of shared memory a block are sm_80's.
MIN_CAPABILITY = (8, 0)


class UnsupportedDeviceError(RuntimeError):
    """The GPU is older than the kernels need (compute capability below MIN_CAPABILITY)."""


def check_capability(device: int) -> None:
    """Raise UnsupportedDeviceError when ``device`` is older than MIN_CAPABILITY."""
    cc = compute_capability(device)
    if cc >= MIN_CAPABILITY:
        return
    try:
        import cupy

        name = cupy.cuda.runtime.getDeviceProperties(device)["name"]
        name = f" ({name.decode() if isinstance(name, bytes) else name})"
    except Exception:  # noqa: BLE001 - the name is only for the message
        name = ""
    raise UnsupportedDeviceError(
        f"cukern's kernels need a GPU of compute capability {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer "
        f"(A100, A10, RTX 30 and 40 series, L4, L40, H100, H200, ...); device {device}{name} has "
        f"{cc[0]}.{cc[1]}")


def max_shared_memory(device: int) -> int:
    """The most shared memory a block of ``device`` may opt in to, in bytes."""
    n = _smem_optin.get(device)
    if n is None:
        import cupy

        n = _smem_optin[device] = int(cupy.cuda.runtime.getDeviceProperties(device)["sharedMemPerBlockOptin"])
    return n


def sm_count(device: int) -> int:
    n = _sm_counts.get(device)
    if n is None:
        import cupy

        n = _sm_counts[device] = cupy.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"]
    return n


class Slot:
    """An array argument filled in per call: buffer ``index`` of the plan's buffer list, plus
    ``offset`` bytes (a part of a scratch block)."""

    __slots__ = ("index", "offset")

    def __init__(self, index: int, offset: int = 0):
        self.index, self.offset = index, offset

    def __add__(self, offset: int) -> "Slot":
        return Slot(self.index, self.offset + offset)

    def __repr__(self) -> str:
        return f"Slot({self.index}{f', {self.offset}' if self.offset else ''})"


class MapSlot:
    """A CUtensorMap argument made per call from buffer ``index`` (its pointer changes from call
    to call): TMA boxes of ``box`` elements (NumPy order), ``swizzle`` bytes (cukern._tensormap)."""

    __slots__ = ("index", "box", "swizzle")

    def __init__(self, index: int, box: tuple, swizzle: int = 128):
        self.index, self.box, self.swizzle = index, tuple(box), swizzle

    def __repr__(self) -> str:
        return f"MapSlot({self.index}, {self.box}, {self.swizzle})"


# Kernel arguments are packed into one buffer laid out as the C parameter list (each value at
# its natural alignment, which struct's native mode gives) and handed to cuLaunchKernel through
# CU_LAUNCH_PARAM_BUFFER_POINTER: no per-argument wrapper objects.
_PARAM_BYTES = 4096
_local = threading.local()


def _param_buffer():
    """This thread's parameter buffer and the cuLaunchKernel ``extra`` array pointing at it."""
    st = getattr(_local, "params", None)
    if st is None:
        buf = (ctypes.c_uint64 * (_PARAM_BYTES // 8))()
        size = ctypes.c_size_t(0)
        # CU_LAUNCH_PARAM_BUFFER_POINTER (1), the buffer, CU_LAUNCH_PARAM_BUFFER_SIZE (2), a
        # pointer to its size, CU_LAUNCH_PARAM_END (0)
        extra = (ctypes.c_void_p * 5)(1, ctypes.addressof(buf), 2, ctypes.addressof(size), 0)
        # (extra itself is kept alive here: the driver reads it through its address)
        st = _local.params = (buf, size, ctypes.addressof(extra), extra)
    return st


def _dims(d) -> tuple[int, int, int]:
    if isinstance(d, tuple):
        return tuple(int(v) for v in (tuple(d) + (1, 1))[:3])
    return int(d), 1, 1


_LIMITS = {"q": (-2**63, 2**63 - 1), "i": (-2**31, 2**31 - 1), "Q": (0, 2**64 - 1), "I": (0, 2**32 - 1)}


class Kernel:
    """A compiled instance on one device, with its declared signature."""

    def __init__(self, inst: Instance, device: int):
        self.instance = inst
        self.device = device
        self.fn = function(inst.source, inst.name, device, inst.arch)
        self.signature = signature(inst)
        self._occupancy: dict[int, int] = {}
        import cupy

        # (on the kernel's device: a thread's current device may be another, and CuPy loads a
        # RawKernel for the current one)
        with cupy.cuda.Device(device):
            self.ptr = self.fn.kernel.ptr
            # the opt-in above the default 48 KB (static shared memory counts too: opt in at any size)
            if inst.smem and self.fn.max_dynamic_shared_size_bytes < inst.smem:
                self.fn.max_dynamic_shared_size_bytes = inst.smem
            if inst.cluster > 8:
                from . import _driver

                _driver.allow_non_portable_cluster_size(self.ptr)

    def resident_blocks(self, threads: int | None = None) -> int:
        """How many blocks fit on the whole device at once (the persistent grid size)."""
        threads = threads or self.instance.threads
        n = self._occupancy.get(threads)
        if n is None:
            import cupy

            with cupy.cuda.Device(self.device):
                per_sm = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(
                    self.ptr, threads, self.instance.smem)
            n = self._occupancy[threads] = max(1, per_sm) * sm_count(self.device)
        return n

    def prepare(self, grid, block=None, **args) -> "Launch":
        """A launch of ``grid`` blocks (int or tuple) of ``block`` threads (default: the
        instance's) with the arguments by parameter name (see ``pack``)."""
        dtypes = args.pop("dtypes", {})
        layout, values, slots = pack(self.signature, self.instance.name, args, dtypes)
        return Launch(self, _dims(grid), _dims(block or self.instance.threads), layout, values, slots)


def pack(sig: Signature, what: str, args: dict, dtypes: dict) -> tuple[struct.Struct, list, tuple]:
    """(layout, values, slots): ``args`` by parameter name checked against the declared
    signature and laid out as the C parameter list. A value is a Python number for a scalar
    (packed as the declared C type; an integer type takes integers only, within its range),
    ``Slot(i)`` for an array filled in per call (its dtype, ``dtypes[i]``, must be the pointer's
    element type), a DeviceArray for a fixed array, or None for a null pointer."""
    missing = [n for n in sig.names if n not in args]
    unknown = [n for n in args if n not in sig.names]
    if missing or unknown:
        raise TypeError(f"{what}: arguments do not match the declared parameters "
                        f"(missing {missing}, unknown {unknown})")
    values, slots = [], []
    for i, (name, code, dtype) in enumerate(zip(sig.names, sig.codes, sig.dtypes)):
        v = args[name]
        if code == "P":
            if v is None:
                values.append(0)
                continue
            if isinstance(v, Slot):
                got = dtypes.get(v.index)
                slots.append((i, v.index, v.offset))
                values.append(0)
            elif hasattr(v, "ptr") and hasattr(v, "dtype"):
                got = v.dtype
                values.append(int(v.ptr))
            else:
                raise TypeError(f"{what}: parameter {name} is a pointer; got {v!r}")
            if dtype is not None and got is not None and got != dtype:
                raise TypeError(f"{what}: parameter {name} points to {dtype}, but the array given has dtype {got}")
            continue
        if code == TENSOR_MAP:
            if isinstance(v, MapSlot):   # (encoded per call from the buffer: see Launch)
                slots.append((i, v, 0))
                values.append(bytes(128))
                continue
            raw = getattr(v, "raw", v)
            if not isinstance(raw, bytes) or len(raw) != 128:
                raise TypeError(f"{what}: parameter {name} is a CUtensorMap (128 bytes); got {v!r:.80}")
            values.append(raw)
            continue
        if isinstance(v, (bool, np.bool_)) or not isinstance(v, (int, float, np.integer, np.floating)):
            raise TypeError(f"{what}: parameter {name} is a scalar of C type {code!r}; got {v!r}")
        if code in _LIMITS:
            if isinstance(v, (float, np.floating)):
                raise TypeError(f"{what}: parameter {name} is an integer; got {v!r}")
            lo, hi = _LIMITS[code]
            if not lo <= int(v) <= hi:
                raise ValueError(f"{what}: {name} = {v} is outside the range of its C type [{lo}, {hi}]")
            values.append(int(v))
        else:
            values.append(float(v))
    layout = struct.Struct(sig.format)
    if layout.size > _PARAM_BYTES:
        raise ValueError(f"{what}: arguments take {layout.size} bytes; at most {_PARAM_BYTES}")
    return layout, values, tuple(slots)


class Launch:
    """One prepared launch: constants packed; per call, the slots' pointers and the stream."""

    __slots__ = ("kernel", "grid", "block", "layout", "values", "slots", "maps", "offsets", "_args", "_encoders")

    def __init__(self, kernel: Kernel, grid, block, layout: struct.Struct, values: list, slots):
        self.kernel, self.grid, self.block = kernel, grid, block
        self.layout, self.values = layout, values
        self.slots = tuple(s for s in slots if not isinstance(s[1], MapSlot))
        self.maps = tuple((at, m) for at, m, _ in slots if isinstance(m, MapSlot))
        self._encoders = None   # (a _tensormap.MapEncoder a map, made at the first call)
        # A kernel taking a tensor map (a 64-byte-aligned __grid_constant__) is launched with
        # cuLaunchKernel's kernelParams (a pointer to each parameter in the packed buffer): with the
        # buffer handed over whole (CU_LAUNCH_PARAM_BUFFER_POINTER), its TMA loads fault with an
        # illegal instruction on an H200 (driver 580), though the bytes are the same.
        sig = getattr(kernel, "signature", None)
        self.offsets = sig.param_offsets if sig is not None and TENSOR_MAP in sig.codes else None
        self._args = (kernel.ptr, *grid, *block, kernel.instance.smem)

    def __call__(self, bufs, ptrs, stream: int) -> None:
        """Launch with ``ptrs[slot]`` for each slot (and each map slot's tensor map of
        ``bufs[index]``), on ``stream`` (a raw CUDA stream handle). (The signature of a plan
        step: ``bufs`` is the plan's buffer list.)"""
        values = self.values
        if self.slots or self.maps:
            values = values.copy()
            for at, slot, offset in self.slots:
                values[at] = ptrs[slot] + offset
            if self.maps:
                encoders = self._encoders
                if encoders is None:
                    from ._tensormap import MapEncoder

                    encoders = self._encoders = tuple(MapEncoder(m.box, m.swizzle) for _, m in self.maps)
                for (at, m), encode in zip(self.maps, encoders):
                    values[at] = encode(bufs[m.index])
        buf, size, extra, _ = _param_buffer()
        self.layout.pack_into(buf, 0, *values)
        if self.offsets is not None:
            _launch_kernel(*self._args, stream, _param_pointers(self.offsets), 0)
            return
        size.value = self.layout.size
        _launch_kernel(*self._args, stream, 0, extra)


def _param_pointers(offsets: tuple) -> int:
    """The address of an array of pointers to each parameter in this thread's buffer
    (cuLaunchKernel's kernelParams), made once a thread and parameter list."""
    cache = _local.__dict__.setdefault("pointers", {})
    arr = cache.get(offsets)
    if arr is None:
        base = ctypes.addressof(_param_buffer()[0])
        arr = cache[offsets] = (ctypes.c_void_p * len(offsets))(*[base + o for o in offsets])
    return ctypes.addressof(arr)


def _launch_kernel(*args):
    global _launch_kernel
    import cupy

    _launch_kernel = cupy.cuda.driver.launchKernel
    _launch_kernel(*args)


_kernels: dict[tuple[Instance, int], Kernel] = {}


def kernel(inst: Instance, device: int) -> Kernel:
    """The :class:`Kernel` for ``inst`` on ``device`` (compiled on first use)."""
    k = _kernels.get((inst, device))
    if k is None:
        k = _kernels[(inst, device)] = Kernel(inst, device)
    return k
