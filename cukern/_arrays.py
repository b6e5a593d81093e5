"""Accepting CuPy arrays, torch CUDA tensors and DLPack objects; answering in the caller's type.

Kernels see a `DeviceArray`: pointer, shape, strides in elements, dtype name and device.
Torch tensors are read through ``data_ptr()``/``stride()`` (zero copy, no DLPack round trip on
the hot path) and outputs for them are allocated with torch, on torch's caching allocator;
CuPy arrays likewise get CuPy outputs. Other objects that speak DLPack on a CUDA device are
imported with ``cupy.from_dlpack`` (zero copy) and answered with CuPy arrays.

Kernels are launched on the caller's current stream: torch's for torch tensors, CuPy's for
everything else. Nothing here synchronizes the device.

The NumPy references (``cukern.reference``) check their arguments with the same family checks
as the kernels: ``as_host_array`` gives them the same view of a NumPy array, so a bad argument
gets the same message from both.
"""
from __future__ import annotations

import math
import sys
import threading

import numpy as np

__all__ = ["DeviceArray", "as_device_array", "as_host_array", "empty", "empty_like", "zeros",
           "launch_stream", "DTYPES"]

# dtype name -> (CUDA storage type in cuda_src/common/dtype.cuh, bytes per element)
DTYPES = {"float32": ("float", 4), "float16": ("cuk::half", 2), "bfloat16": ("cuk::bf16", 2)}
FLOATS = tuple(DTYPES)
# Output-only fp8 dtypes (OCP E4M3 "fn", E5M2) -> their storage types. torch callers get torch's
# float8 tensors; CuPy has no fp8 dtype, so CuPy callers get uint8 arrays of the same bytes.
FP8 = {"float8_e4m3fn": ("cuk::fp8e4m3", 1), "float8_e5m2": ("cuk::fp8e5m2", 1)}

_DLPACK_CUDA = (2, 13)  # kDLCUDA, kDLCUDAManaged


class DeviceArray:
    """A view of one argument: where its elements are and how they are laid out."""

    __slots__ = ("obj", "kind", "ptr", "shape", "strides", "dtype", "device", "name")

    def __init__(self, obj, kind, ptr, shape, strides, dtype, device, name):
        self.obj = obj          # the torch.Tensor, cupy.ndarray (or, for references, numpy array)
        self.kind = kind        # "torch", "cupy" or "numpy"
        self.ptr = ptr
        self.shape = tuple(shape)
        self.strides = tuple(strides)  # in elements
        self.dtype = dtype      # "float32", "float16", "bfloat16", "int32", "int64", ...
        self.device = device    # CUDA device ordinal (-1 for host arrays)
        self.name = name        # the argument's name, for messages

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return 2 if self.dtype == "bfloat16" else 1 if self.dtype in FP8 else np.dtype(self.dtype).itemsize

    @property
    def ctype(self) -> str:
        return DTYPES[self.dtype][0]

    @property
    def key(self) -> tuple:
        """What a launch plan depends on: everything but the address, and its 16-byte alignment."""
        return (self.kind, self.shape, self.strides, self.dtype, self.device, self.ptr % 16 == 0)

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
        if is_contiguous(self):
            return self
        if self.kind == "torch":
            obj = self.obj.contiguous()
        elif self.kind == "numpy":
            obj = np.ascontiguousarray(self.obj)
        else:
            import cupy

            with cupy.cuda.Device(self.device):  # (ascontiguousarray would make 0-d arrays 1-d)
                obj = self.obj.copy(order="C")
        return wrap(obj, self.name)

    def copy(self) -> "DeviceArray":
        """A fresh C-contiguous copy (new allocation: 256-byte aligned), even when ``self`` is
        contiguous already — for kernels that need aligned rows of a misaligned view."""
        if self.kind == "torch":
            import torch

            obj = self.obj.clone(memory_format=torch.contiguous_format)
        elif self.kind == "numpy":
            obj = self.obj.copy(order="C")
        else:
            import cupy

            with cupy.cuda.Device(self.device):
                obj = self.obj.copy(order="C")
        return wrap(obj, self.name)

    def reshape(self, shape) -> "DeviceArray":
        """View of a contiguous array with another shape."""
        return wrap(self.obj.reshape(shape), self.name)

    def batched(self) -> "DeviceArray":
        """A view with a leading axis of 1 (packed documents read as one batch)."""
        return wrap(self.obj[None], self.name)

    def permute(self, axes) -> "DeviceArray":
        obj = self.obj.permute(*axes) if self.kind == "torch" else self.obj.transpose(axes)
        return wrap(obj, self.name)


_torch_dtype_names: dict[object, str] = {}
_torch_tensor = None   # torch.Tensor once torch has been imported by someone


def _torch_dtype_name(t) -> str:
    name = _torch_dtype_names.get(t.dtype)
    if name is None:
        name = _torch_dtype_names[t.dtype] = str(t.dtype).replace("torch.", "")
    return name


def wrap(obj, name: str) -> DeviceArray:
    """A DeviceArray of a torch tensor, CuPy array or NumPy array (no checks)."""
    global _torch_tensor
    if _torch_tensor is None and "torch" in sys.modules:
        _torch_tensor = sys.modules["torch"].Tensor
    if _torch_tensor is not None and isinstance(obj, _torch_tensor):
        return DeviceArray(obj, "torch", obj.data_ptr(), obj.shape, obj.stride(),
                           _torch_dtype_name(obj), obj.device.index, name)
    itemsize = obj.dtype.itemsize
    strides = []
    for s in obj.strides:
        if s % itemsize:
            raise ValueError(f"{name}: strides {obj.strides} are not multiples of the item size")
        strides.append(s // itemsize)
    if isinstance(obj, np.ndarray):
        return DeviceArray(obj, "numpy", obj.ctypes.data, obj.shape, strides, obj.dtype.name, -1, name)
    return DeviceArray(obj, "cupy", obj.data.ptr, obj.shape, strides, obj.dtype.name, obj.device.id, name)


def _not_an_array(obj, name: str, expected: str = "a CuPy array or a torch CUDA tensor") -> TypeError:
    """The error for an argument that is no array at all, saying what it is."""
    if isinstance(obj, (str, bytes)):
        what = f"a string ({obj!r:.40})"
    elif isinstance(obj, (bool, np.bool_)):
        what = f"a bool ({obj!r})"
    elif isinstance(obj, (int, float, complex, np.number)):
        what = f"a {type(obj).__name__} scalar ({obj!r})"
    else:
        what = f"a {type(obj).__module__}.{type(obj).__qualname__}"
    return TypeError(f"{name}: expected {expected}, got {what}")


def as_device_array(obj, name: str, dtypes=FLOATS) -> DeviceArray:
    """Validate one argument: a CUDA array of one of ``dtypes``. Errors name the argument."""
    if _torch_tensor is not None and type(obj) is _torch_tensor and obj.is_cuda:   # the hot path
        arr = DeviceArray(obj, "torch", obj.data_ptr(), obj.shape, obj.stride(), _torch_dtype_name(obj),
                          obj.device.index, name)
    elif obj is None:
        raise TypeError(f"{name}: required, got None")
    elif isinstance(obj, np.ndarray):
        raise TypeError(
            f"{name}: a host (NumPy) array; cukern runs on CUDA arrays (cupy.asarray(...) or a "
            "torch CUDA tensor). The NumPy references are in cukern.reference")
    elif "torch" in sys.modules and isinstance(obj, sys.modules["torch"].Tensor):
        if obj.device.type != "cuda":
            raise TypeError(
                f"{name}: a torch tensor on {obj.device}; cukern runs on CUDA tensors "
                "(move it with .cuda(), or use cukern.reference for a NumPy computation)")
        arr = wrap(obj, name)
    elif type(obj).__module__.split(".")[0] == "cupy" and hasattr(obj, "data") and hasattr(obj, "device"):
        arr = wrap(obj, name)
    elif hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        dev_type, _ = obj.__dlpack_device__()
        if int(dev_type) not in _DLPACK_CUDA:
            raise TypeError(f"{name}: a DLPack object on a non-CUDA device (type {dev_type}); "
                            "cukern runs on CUDA arrays")
        import cupy

        arr = wrap(cupy.from_dlpack(obj), name)
    else:
        raise _not_an_array(obj, name)
    if arr.dtype not in dtypes:
        raise ValueError(f"{name}: dtype {arr.dtype} is not supported (expected one of {', '.join(dtypes)})")
    return arr


def as_host_array(obj, name: str, dtypes=FLOATS) -> DeviceArray:
    """The references' counterpart of ``as_device_array``: a NumPy array (or anything
    ``np.asarray`` takes but a scalar or a string) of one of ``dtypes`` or float64 (the
    references compute in float64 and accept it wherever a float dtype is)."""
    if obj is None:
        raise TypeError(f"{name}: required, got None")
    if isinstance(obj, (str, bytes, int, float, complex, np.number, np.bool_)):
        raise _not_an_array(obj, name, "an array")
    a = np.asarray(obj)
    if a.dtype == object:
        raise TypeError(f"{name}: expected an array, got {type(obj).__name__}")
    allowed = tuple(dtypes) + (("float64",) if set(dtypes) & set(FLOATS) else ())
    if a.dtype.name not in allowed:   # (the kernels' message: float64 is the references' extra)
        raise ValueError(f"{name}: dtype {a.dtype.name} is not supported (expected one of {', '.join(dtypes)})")
    return wrap(a, name)


def same_device(*arrays: DeviceArray | None) -> int:
    """The one device holding every given array; ValueError naming the odd one out."""
    given = [a for a in arrays if a is not None]
    first = given[0]
    for a in given[1:]:
        if a.device != first.device:
            raise ValueError(f"{a.name}: on CUDA device {a.device}, but {first.name} is on "
                             f"device {first.device}; all inputs must be on one device")
    return first.device


# ---- allocation --------------------------------------------------------------------------------

def empty(like: DeviceArray, shape, dtype: str | None = None) -> DeviceArray:
    """A new contiguous array of the same kind and device as ``like``."""
    dtype = dtype or like.dtype
    if like.kind == "torch":
        import torch

        obj = torch.empty(tuple(shape), dtype=getattr(torch, dtype), device=like.obj.device)
    elif like.kind == "numpy":
        obj = np.empty(tuple(shape), dtype=_np_dtype(dtype))
    else:
        import cupy

        with cupy.cuda.Device(like.device):
            obj = cupy.empty(tuple(shape), dtype=_np_dtype(dtype))
    return wrap(obj, "output")


def stride_order(shape, strides) -> tuple[int, ...]:
    """The axes from the largest stride to the smallest (ties: the outer axis first), an axis
    broadcast over several elements (stride 0: K and V expanded over the heads) before all of
    them: it has no place in memory, and ordered by its 0 it would go innermost, past the
    unit-stride axis the kernels write an output like it with."""
    return tuple(sorted(range(len(shape)), key=lambda i: (strides[i] != 0 or shape[i] <= 1, -strides[i], i)))


def like_strides(shape, strides) -> tuple[int, ...]:
    """Dense strides (elements) for ``shape`` in the stride order of ``strides``: the layout
    of an output that keeps its input's layout (a dense input gets its own strides back)."""
    out, step = [0] * len(shape), 1
    for ax in reversed(stride_order(shape, strides)):
        out[ax] = step
        step *= max(shape[ax], 1)
    return tuple(out)


def empty_like(like: DeviceArray, dtype: str | None = None, shape=None) -> DeviceArray:
    """A new array of ``like``'s shape (or ``shape``, of its rank) laid out in ``like``'s stride
    order (``like_strides``)."""
    shape = like.shape if shape is None else tuple(shape)
    order = stride_order(like.shape, like.strides)
    if order == tuple(range(like.ndim)):
        return empty(like, shape, dtype)
    if like.kind == "torch":
        import torch

        obj = torch.empty_strided(shape, like_strides(shape, like.strides),
                                  dtype=getattr(torch, dtype or like.dtype), device=like.obj.device)
        return wrap(obj, "output")
    stored = empty(like, tuple(shape[i] for i in order), dtype)
    inverse = [0] * like.ndim
    for pos, ax in enumerate(order):
        inverse[ax] = pos
    return stored.permute(inverse)


def _to_channels_last_axes(ndim: int) -> tuple[int, ...]:
    """(N, C, *S) -> (N, *S, C)."""
    return (0,) + tuple(range(2, ndim)) + (1,)


def _from_channels_last_axes(ndim: int) -> tuple[int, ...]:
    """(N, *S, C) -> (N, C, *S)."""
    return (0, ndim - 1) + tuple(range(1, ndim - 1))


def empty_channels_last(like: DeviceArray, shape, dtype: str | None = None) -> DeviceArray:
    """A new (N, C, *S) array stored channels-last, i.e. a view of a contiguous (N, *S, C)."""
    shape = tuple(shape)
    stored = tuple(shape[i] for i in _to_channels_last_axes(len(shape)))
    return empty(like, stored, dtype).permute(_from_channels_last_axes(len(shape)))


def channels_last(arr: DeviceArray) -> DeviceArray:
    """``arr`` (N, C, *S) stored channels-last: itself when it already is, else a copy."""
    if is_channels_last(arr):
        return arr
    copy = arr.permute(_to_channels_last_axes(arr.ndim)).contiguous()
    return copy.permute(_from_channels_last_axes(arr.ndim))


def is_channels_last(arr: DeviceArray) -> bool:
    """Whether (N, C, *S) is stored densely as (N, *S, C) (axes of size 1 may have any stride)."""
    if arr.ndim < 3:
        return False
    expect = 1
    for ax in reversed(_to_channels_last_axes(arr.ndim)):
        n = arr.shape[ax]
        if n != 1 and arr.strides[ax] != expect:
            return False
        expect *= n
    return True


def rows_view(a: DeviceArray) -> tuple[bool, int]:
    """(copy needed, row stride) of ``a`` read as (rows, shape[-1]): the last axis must be
    unit-stride and the leading axes one uniformly strided axis; otherwise kernels read a
    contiguous copy (whose row stride is shape[-1])."""
    stride = a.row_stride()
    return (True, a.shape[-1]) if stride is None else (False, stride)


def vector_width(itemsize: int, cols: int, arrays) -> int:
    """Elements of a 16-byte vector when every row of every (array, row stride) pair starts
    16-byte aligned (None: a fresh copy, aligned) and ``cols`` is a multiple of it, else 1."""
    vec = 16 // itemsize
    if cols % vec:
        return 1
    for a, stride in arrays:
        if a is not None and (a.ptr % 16 or stride % vec):
            return 1
    return vec


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
    fill(out, 0.0)
    return out


def fill(arr: DeviceArray, value: float) -> None:
    """Fill on the caller's stream (scratch that starts at zero, degenerate shapes' outputs)."""
    if arr.kind == "torch":
        arr.obj.fill_(value)
    elif arr.kind == "numpy":
        arr.obj.fill(value)
    else:
        import cupy

        with cupy.cuda.Device(arr.device):
            arr.obj.fill(value)


def _np_dtype(dtype: str):
    if dtype == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    if dtype in FP8:   # (CuPy's arrays: the bytes, as uint8)
        return np.uint8
    return np.dtype(dtype)


# ---- streams and devices -----------------------------------------------------------------------

_raw_stream = None


def launch_stream(like: DeviceArray) -> int:
    """The raw handle of the caller's current stream on ``like``'s device: torch's for torch
    tensors, CuPy's otherwise. The caller must have made that device current."""
    global _raw_stream
    if like.kind == "torch":
        if _raw_stream is None:
            import torch

            _raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or (
                lambda d: torch.cuda.current_stream(d).cuda_stream)
        return _raw_stream(like.device)
    import cupy

    return cupy.cuda.get_current_stream().ptr


class on_device:
    """Make ``device`` current for the block (CUDA's runtime device, which the driver's launch
    and CuPy's allocations use), restoring the previous one after; a no-op when it already is.

    A thread that has made no CUDA runtime call yet (the autograd engine's device thread,
    whose tensors all came from torch's cache) reports device 0 but has no context current, and
    a driver launch there fails with CUDA_ERROR_INVALID_CONTEXT; so the first use of a device
    on each thread sets it, which binds its primary context."""

    __slots__ = ("device", "previous")
    _runtime = None
    _bound = threading.local()   # .devices: the devices this thread has set

    def __init__(self, device: int):
        self.device = device

    def __enter__(self):
        rt = on_device._runtime
        if rt is None:
            import cupy

            rt = on_device._runtime = cupy.cuda.runtime
        self.previous = rt.getDevice()
        if self.previous != self.device:
            rt.setDevice(self.device)
        else:
            bound = getattr(on_device._bound, "devices", None)
            if bound is None:
                bound = on_device._bound.devices = set()
            if self.device not in bound:
                rt.setDevice(self.device)
                bound.add(self.device)
        return self

    def __exit__(self, *exc):
        if self.previous != self.device:
            on_device._runtime.setDevice(self.previous)
        return False


def as_cupy(arr: DeviceArray):
    """A CuPy view of ``arr``'s memory (zero copy), for CuPy routines on torch tensors too.
    The view keeps ``arr.obj`` alive."""
    import cupy

    if arr.kind == "cupy":
        return arr.obj
    mem = cupy.cuda.UnownedMemory(arr.ptr, arr.size * arr.itemsize, arr.obj, arr.device)
    return cupy.ndarray(arr.shape, _np_dtype(arr.dtype), cupy.cuda.MemoryPointer(mem, 0),
                        tuple(s * arr.itemsize for s in arr.strides))
