"""Accepting CuPy arrays, torch CUDA tensors and DLPack objects; answering in the caller's type.

Kernels see a `DeviceArray`: pointer, shape, strides in elements, dtype name and device.
Torch tensors are read through ``data_ptr()``/``stride()`` (zero copy, no DLPack round trip on
the hot path) and outputs for them are allocated with torch, on torch's caching allocator;
CuPy arrays likewise get CuPy outputs. Other objects that speak DLPack on a CUDA device are
imported with ``cupy.from_dlpack`` (zero copy) and answered with CuPy arrays.

Kernels are launched on the caller's current stream: torch's for torch tensors, CuPy's for
everything else. Nothing here synchronizes the device.
"""
from __future__ import annotations

import contextlib
import math
import sys
import warnings

import numpy as np

__all__ = ["DeviceArray", "as_device_array", "empty", "zeros", "launch_context", "DTYPES"]

# dtype name -> (CUDA storage type in cuda_src/common/dtype.cuh, bytes per element)
DTYPES = {"float32": ("float", 4), "float16": ("cuk_half", 2), "bfloat16": ("cuk_bf16", 2)}

_DLPACK_CUDA = (2, 13)  # kDLCUDA, kDLCUDAManaged


class DeviceArray:
    """A view of one argument: where its elements are and how they are laid out."""

    __slots__ = ("obj", "kind", "ptr", "shape", "strides", "dtype", "device", "name")

    def __init__(self, obj, kind, ptr, shape, strides, dtype, device, name):
        self.obj = obj          # the torch.Tensor or cupy.ndarray itself
        self.kind = kind        # "torch" or "cupy"
        self.ptr = ptr
        self.shape = tuple(shape)
        self.strides = tuple(strides)  # in elements
        self.dtype = dtype      # "float32", "float16", "bfloat16", "int32", "int64", ...
        self.device = device    # CUDA device ordinal
        self.name = name        # the argument's name, for messages

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return np.dtype(self.dtype).itemsize if self.dtype != "bfloat16" else 2

    @property
    def ctype(self) -> str:
        return DTYPES[self.dtype][0]

    def row_stride(self) -> int | None:
        """Element stride between consecutive rows when viewed as (rows, shape[-1]).

        None when the last axis is not unit-stride or the leading axes cannot be merged
        into one uniformly strided axis (the caller then makes a contiguous copy).
        """
        shape, strides = self.shape, self.strides
        if not shape:
            return None
        if shape[-1] > 1 and strides[-1] != 1:
            return None
        lead = [(n, s) for n, s in zip(shape[:-1], strides[:-1]) if n != 1]
        if not lead:
            return shape[-1]
        stride = lead[-1][1]
        expect = stride
        for n, s in reversed(lead):
            if s != expect:
                return None
            expect = s * n
        return stride

    def contiguous(self) -> "DeviceArray":
        """A C-contiguous copy (or self when already contiguous), same type and device."""
        if self.kind == "torch":
            obj = self.obj.contiguous()
        elif self.obj.flags.c_contiguous:
            return self
        else:
            import cupy

            with cupy.cuda.Device(self.device):  # (ascontiguousarray would make 0-d arrays 1-d)
                obj = self.obj.copy(order="C")
        if obj is self.obj:
            return self
        return _wrap(obj, self.name)

    def copy(self) -> "DeviceArray":
        """A fresh C-contiguous copy (new allocation: 256-byte aligned), even when ``self`` is
        contiguous already — for kernels that need aligned rows of a misaligned view."""
        if self.kind == "torch":
            import torch

            obj = self.obj.clone(memory_format=torch.contiguous_format)
        else:
            import cupy

            with cupy.cuda.Device(self.device):
                obj = self.obj.copy(order="C")
        return _wrap(obj, self.name)

    def reshape(self, shape) -> "DeviceArray":
        """View of a contiguous array with another shape."""
        return _wrap(self.obj.reshape(shape), self.name)


_torch_dtype_names: dict[object, str] = {}


def _torch_dtype_name(t) -> str:
    name = _torch_dtype_names.get(t.dtype)
    if name is None:
        name = _torch_dtype_names[t.dtype] = str(t.dtype).replace("torch.", "")
    return name


def _wrap(obj, name: str) -> DeviceArray:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return DeviceArray(obj, "torch", obj.data_ptr(), obj.shape, obj.stride(),
                           _torch_dtype_name(obj), obj.device.index, name)
    itemsize = obj.dtype.itemsize
    strides = []
    for s in obj.strides:
        if s % itemsize:
            raise ValueError(f"{name}: strides {obj.strides} are not multiples of the item size")
        strides.append(s // itemsize)
    return DeviceArray(obj, "cupy", obj.data.ptr, obj.shape, strides, _np_dtype_name(obj.dtype),
                       obj.device.id, name)


def _np_dtype_name(dt) -> str:
    return np.dtype(dt).name


def as_device_array(obj, name: str, dtypes=("float32", "float16", "bfloat16")) -> DeviceArray:
    """Validate one argument: a CUDA array of one of ``dtypes``. Errors name the argument."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        if obj.device.type != "cuda":
            raise TypeError(
                f"{name}: a torch tensor on {obj.device}; cukern runs on CUDA tensors "
                "(move it with .cuda(), or use cukern.reference for a NumPy computation)")
        arr = _wrap(obj, name)
    elif isinstance(obj, np.ndarray) or np.isscalar(obj):
        raise TypeError(
            f"{name}: a host (NumPy) array; cukern runs on CUDA arrays (cupy.asarray(...) or a "
            "torch CUDA tensor). The NumPy references are in cukern.reference")
    elif type(obj).__module__.split(".")[0] == "cupy" and hasattr(obj, "data") and hasattr(obj, "device"):
        arr = _wrap(obj, name)
    elif hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        dev_type, _ = obj.__dlpack_device__()
        if int(dev_type) not in _DLPACK_CUDA:
            raise TypeError(f"{name}: a DLPack object on a non-CUDA device (type {dev_type}); "
                            "cukern runs on CUDA arrays")
        import cupy

        arr = _wrap(cupy.from_dlpack(obj), name)
    elif obj is None:
        raise TypeError(f"{name}: required, got None")
    else:
        raise TypeError(f"{name}: expected a CuPy array or a torch CUDA tensor, got {type(obj).__name__}")
    if arr.dtype not in dtypes:
        raise ValueError(f"{name}: dtype {arr.dtype} is not supported (expected one of {', '.join(dtypes)})")
    return arr


def same_device(*arrays: DeviceArray | None) -> int:
    """The one device holding every given array; ValueError naming the odd one out."""
    given = [a for a in arrays if a is not None]
    first = given[0]
    for a in given[1:]:
        if a.device != first.device:
            raise ValueError(f"{a.name}: on CUDA device {a.device}, but {first.name} is on "
                             f"device {first.device}; all inputs must be on one device")
    return first.device


def empty(like: DeviceArray, shape, dtype: str | None = None) -> DeviceArray:
    """A new contiguous array of the same kind and device as ``like``."""
    dtype = dtype or like.dtype
    if like.kind == "torch":
        import torch

        obj = torch.empty(tuple(shape), dtype=getattr(torch, dtype), device=like.obj.device)
    else:
        import cupy

        with cupy.cuda.Device(like.device):
            obj = cupy.empty(tuple(shape), dtype=_cupy_dtype(dtype))
    return _wrap(obj, "output")


def _to_channels_last_axes(ndim: int) -> tuple[int, ...]:
    """(N, C, *S) -> (N, *S, C)."""
    return (0,) + tuple(range(2, ndim)) + (1,)


def _from_channels_last_axes(ndim: int) -> tuple[int, ...]:
    """(N, *S, C) -> (N, C, *S)."""
    return (0, ndim - 1) + tuple(range(1, ndim - 1))


def _permute(obj, axes):
    return obj.permute(*axes) if hasattr(obj, "permute") else obj.transpose(axes)


def empty_channels_last(like: DeviceArray, shape, dtype: str | None = None) -> DeviceArray:
    """A new (N, C, *S) array stored channels-last, i.e. a view of a contiguous (N, *S, C)."""
    shape = tuple(shape)
    stored = tuple(shape[i] for i in _to_channels_last_axes(len(shape)))
    base = empty(like, stored, dtype)
    return _wrap(_permute(base.obj, _from_channels_last_axes(len(shape))), "output")


def channels_last(arr: DeviceArray) -> DeviceArray:
    """``arr`` (N, C, *S) stored channels-last: itself when it already is, else a copy."""
    if is_channels_last(arr):
        return arr
    stored = _permute(arr.obj, _to_channels_last_axes(arr.ndim))
    copy = _wrap(stored, arr.name).contiguous()
    return _wrap(_permute(copy.obj, _from_channels_last_axes(arr.ndim)), arr.name)


def is_channels_last(arr: DeviceArray) -> bool:
    """Whether (N, C, *S) is stored densely as (N, *S, C) (axes of size 1 may have any stride)."""
    if arr.ndim < 3:
        return False
    axes = _to_channels_last_axes(arr.ndim)
    expect = 1
    for ax in reversed(axes):
        n = arr.shape[ax]
        if n != 1 and arr.strides[ax] != expect:
            return False
        expect *= n
    return True


def is_contiguous(arr: DeviceArray) -> bool:
    """Whether ``arr`` is C-contiguous (axes of size 1 may have any stride)."""
    expect = 1
    for n, s in zip(reversed(arr.shape), reversed(arr.strides)):
        if n != 1 and s != expect:
            return False
        expect *= n
    return True


def zeros(like: DeviceArray, shape, dtype: str | None = None) -> DeviceArray:
    out = empty(like, shape, dtype)
    out.obj.fill_(0) if out.kind == "torch" else out.obj.fill(0)
    return out


def fill(arr: DeviceArray, value: float) -> None:
    """Fill on the caller's stream (used only for degenerate shapes)."""
    if arr.kind == "torch":
        arr.obj.fill_(value)
    else:
        arr.obj.fill(value)


def _cupy_dtype(dtype: str):
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(dtype)


_streams: dict[tuple[int, int], object] = {}


@contextlib.contextmanager
def launch_context(like: DeviceArray):
    """Make ``like``'s device current, and for torch tensors torch's current stream CuPy's."""
    import cupy

    with cupy.cuda.Device(like.device):
        if like.kind == "torch":
            import torch

            raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # (no Stream object a call)
            ptr = raw(like.device) if raw is not None else torch.cuda.current_stream(like.device).cuda_stream
            stream = _streams.get((like.device, ptr))
            if stream is None:
                with warnings.catch_warnings():  # CuPy 14 prefers Stream.from_external, which
                    warnings.simplefilter("ignore", DeprecationWarning)  # needs __cuda_stream__
                    stream = cupy.cuda.ExternalStream(ptr, like.device)
                _streams[(like.device, ptr)] = stream
            with stream:
                yield
        else:
            yield


def as_cupy(arr: DeviceArray):
    """A CuPy view of ``arr``'s memory (zero copy), for CuPy routines on torch tensors too.
    The view keeps ``arr.obj`` alive."""
    import cupy

    if arr.kind == "cupy":
        return arr.obj
    mem = cupy.cuda.UnownedMemory(arr.ptr, arr.size * arr.itemsize, arr.obj, arr.device)
    return cupy.ndarray(arr.shape, _cupy_dtype(arr.dtype), cupy.cuda.MemoryPointer(mem, 0),
                        tuple(s * arr.itemsize for s in arr.strides))
