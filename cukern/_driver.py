"""The CUDA driver calls cukern makes itself, through ctypes on libcuda: loading a cubin built
for one architecture's own features (sm_90a; CuPy builds for the device's plain architecture),
a function's attributes, and encoding TMA tensor maps (``cuTensorMapEncodeTiled``). Every other
driver call goes through CuPy."""
from __future__ import annotations

import ctypes
import functools

__all__ = ["library", "load_function", "set_max_dynamic_shared", "allow_non_portable_cluster_size", "encode_tiled"]

# CUfunction_attribute
MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14


@functools.lru_cache(maxsize=None)
def library() -> ctypes.CDLL:
    """libcuda (the driver; present wherever a GPU is)."""
    errors = []
    for name in ("libcuda.so.1", "libcuda.so"):
        try:
            return ctypes.CDLL(name)
        except OSError as e:
            errors.append(f"{name}: {e}")
    raise OSError("the CUDA driver (libcuda) cannot be loaded: " + "; ".join(errors))


def check(status: int, what: str) -> None:
    if status != 0:
        msg = ctypes.c_char_p()
        library().cuGetErrorString(status, ctypes.byref(msg))
        raise RuntimeError(f"{what} failed: CUDA driver error {status} ({(msg.value or b'?').decode()})")


class LoadedFunction:
    """A kernel of a loaded cubin: ``ptr`` is its CUfunction handle (what cuLaunchKernel takes);
    the module stays loaded while this object lives."""

    def __init__(self, module: int, ptr: int):
        self.module, self.ptr = module, ptr


def load_function(cubin: bytes, name: str) -> LoadedFunction:
    """Load ``cubin`` into the current context and return its kernel ``name`` (lowered)."""
    lib = library()
    module, fn = ctypes.c_void_p(), ctypes.c_void_p()
    check(lib.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(cubin)), "cuModuleLoadData")
    check(lib.cuModuleGetFunction(ctypes.byref(fn), module, name.encode()), f"cuModuleGetFunction({name})")
    return LoadedFunction(module.value, fn.value)


def max_dynamic_shared(fn: int) -> int:
    value = ctypes.c_int()
    check(library().cuFuncGetAttribute(ctypes.byref(value), MAX_DYNAMIC_SHARED_SIZE_BYTES, ctypes.c_void_p(fn)),
          "cuFuncGetAttribute")
    return value.value


def set_max_dynamic_shared(fn: int, nbytes: int) -> None:
    check(library().cuFuncSetAttribute(ctypes.c_void_p(fn), MAX_DYNAMIC_SHARED_SIZE_BYTES, ctypes.c_int(nbytes)),
          "cuFuncSetAttribute")


def allow_non_portable_cluster_size(fn: int) -> None:
    """Let kernel ``fn`` run clusters of more than 8 CTAs (16 on an H100/H200)."""
    check(library().cuFuncSetAttribute(ctypes.c_void_p(fn), NON_PORTABLE_CLUSTER_SIZE_ALLOWED, ctypes.c_int(1)),
          "cuFuncSetAttribute(non-portable cluster size)")


def encode_tiled(data_type: int, address: int, dims: tuple, strides: tuple, box: tuple, swizzle: int,
                 l2_promotion: int) -> bytes:
    """The 128-byte CUtensorMap of ``cuTensorMapEncodeTiled`` (dims, box innermost first;
    strides in bytes of the dims after the first; interleave none, out-of-bounds zero fill)."""
    rank = len(dims)
    buf = (ctypes.c_uint8 * (128 + 64))()   # (CUtensorMap is alignas(64): the map at a 64-byte boundary)
    at = ctypes.addressof(buf) + (-ctypes.addressof(buf)) % 64
    check(library().cuTensorMapEncodeTiled(
        ctypes.c_void_p(at), ctypes.c_int(data_type), ctypes.c_uint32(rank), ctypes.c_void_p(address),
        (ctypes.c_uint64 * rank)(*dims), (ctypes.c_uint64 * max(1, rank - 1))(*strides),
        (ctypes.c_uint32 * rank)(*box), (ctypes.c_uint32 * rank)(*([1] * rank)),
        ctypes.c_int(0), ctypes.c_int(swizzle), ctypes.c_int(l2_promotion), ctypes.c_int(0)),
        "cuTensorMapEncodeTiled")
    return ctypes.string_at(at, 128)
