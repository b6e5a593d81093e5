"""TMA tensor maps (the driver's CUtensorMap) for the Hopper kernels: a map describes an array
in device memory and the box a ``cp.async.bulk.tensor`` copies into shared memory. Made on the
host (``cuTensorMapEncodeTiled``, cukern._driver) and passed by value to a kernel parameter
declared ``const __grid_constant__ CUtensorMap``.

The driver's rules are checked here first, so that a bad array or box gets an error naming the
argument instead of the driver's CUDA_ERROR_INVALID_VALUE; the checks need no GPU."""
from __future__ import annotations

from dataclasses import dataclass

from . import _driver
from ._arrays import DeviceArray

__all__ = ["MapEncoder", "TensorMap", "check_tile_map", "encode_args", "tile_map"]

DATA_TYPES = {"float16": 6, "float32": 7, "bfloat16": 9}   # CUtensorMapDataType
SWIZZLE = {0: 0, 32: 1, 64: 2, 128: 3}                       # bytes -> CUtensorMapSwizzle
L2_PROMOTION_128B = 2


@dataclass(frozen=True)
class TensorMap:
    """An encoded map (``raw``: the 128 bytes a kernel takes) and the box it loads (NumPy
    order, outermost first) in bytes: ``box_bytes``, what one copy completes on its mbarrier."""
    raw: bytes
    box: tuple[int, ...]
    box_bytes: int


def check_tile_map(name: str, shape: tuple, strides: tuple, itemsize: int, dtype: str, address: int,
                   box: tuple, swizzle: int) -> None:
    """Raise ValueError (naming ``name``) where the driver would refuse the map. ``shape``,
    ``strides`` (elements) and ``box`` in NumPy order (outermost first)."""
    if dtype not in DATA_TYPES:
        raise ValueError(f"{name}: dtype {dtype} has no tensor map here (float16, bfloat16, float32)")
    if not 1 <= len(shape) <= 5:
        raise ValueError(f"{name}: a tensor map takes 1 to 5 axes, got shape {shape}")
    if len(box) != len(shape):
        raise ValueError(f"{name}: box {box} must have one extent an axis of shape {shape}")
    if swizzle not in SWIZZLE:
        raise ValueError(f"swizzle: {swizzle} bytes; one of {sorted(SWIZZLE)}")
    if any(n < 1 or n > 2**32 for n in shape):
        raise ValueError(f"{name}: every axis needs 1 to 2^32 elements, got shape {shape}")
    if strides[-1] != 1:
        raise ValueError(f"{name}: the innermost axis must have unit stride (strides {strides}, in elements)")
    if address % 16:
        raise ValueError(f"{name}: the data must start 16-byte aligned (address {address:#x})")
    for s in strides[:-1]:
        if s * itemsize % 16 or s * itemsize >= 2**40 or s < 1:
            raise ValueError(f"{name}: every outer stride must be a positive multiple of 16 bytes below 2^40 "
                             f"(strides {strides} elements of {itemsize} bytes)")
    if any(b < 1 or b > 256 for b in box):
        raise ValueError(f"{name}: every box extent must be 1 to 256, got box {box}")
    inner = box[-1] * itemsize
    if inner % 16:
        raise ValueError(f"{name}: the box's inner extent ({box[-1]} elements, {inner} bytes) must be a multiple "
                         f"of 16 bytes")
    if swizzle and inner > swizzle:
        raise ValueError(f"{name}: the box's inner extent ({inner} bytes) must fit the {swizzle}-byte swizzle "
                         f"(load wider rows as several boxes)")


def encode_args(a: DeviceArray, box: tuple, swizzle: int = 128) -> tuple:
    """(data type, dims, byte strides, box, swizzle, L2 promotion) of ``a``'s map, as
    ``cuTensorMapEncodeTiled`` takes them (innermost first), checked: all but the address. A
    ``box`` of one axis more than ``a`` reads ``a`` as if it had a leading axis of one (packed
    documents as one batch)."""
    box = tuple(int(b) for b in box)
    shape, elem = tuple(a.shape), list(a.strides)
    if len(box) == len(shape) + 1:   # (a box of one more axis: ``a`` read with a leading axis of one)
        shape, elem = (1, *shape), [0, *elem]
    # (an axis of one element is never stepped over: its stride, which may be anything, 0
    # included, is replaced by one the driver takes)
    for i in range(len(shape) - 2, -1, -1):
        if shape[i] == 1:
            elem[i] = elem[i + 1] * shape[i + 1]
    check_tile_map(a.name, shape, tuple(elem), a.itemsize, a.dtype, a.ptr, box, swizzle)
    return (DATA_TYPES[a.dtype], tuple(reversed(shape)), tuple(s * a.itemsize for s in reversed(elem[:-1])),
            tuple(reversed(box)), SWIZZLE[swizzle], L2_PROMOTION_128B)


def tile_map(a: DeviceArray, box: tuple, *, swizzle: int = 128) -> TensorMap:
    """The map of ``a`` (1 to 5 axes, the innermost unit-stride) loading boxes of ``box``
    elements (NumPy order), out-of-bounds elements read as zero."""
    box = tuple(int(b) for b in box)
    data_type, dims, strides, rbox, swz, l2 = encode_args(a, box, swizzle)
    raw = _driver.encode_tiled(data_type, a.ptr, dims, strides, rbox, swz, l2)
    nbytes = a.itemsize
    for b in box:
        nbytes *= b
    return TensorMap(raw, box, nbytes)


class MapEncoder:
    """The maps of one tensor-map argument of a prepared launch. The plan that holds the launch
    fixes its buffer's shape, strides, dtype and 16-byte alignment, so the checked arguments are
    worked out on the first call and only the address changes; a map is encoded again only for
    an address not among the last few seen (caching allocators hand the same ones back), which
    saves the checks and the driver call, most of a small launch's host time."""

    __slots__ = ("box", "swizzle", "args", "recent")
    RECENT = 8

    def __init__(self, box: tuple, swizzle: int = 128):
        self.box, self.swizzle = tuple(int(b) for b in box), swizzle
        self.args = None
        self.recent: dict[int, bytes] = {}

    def __call__(self, a: DeviceArray) -> bytes:
        """The 128 bytes of ``a``'s map."""
        raw = self.recent.get(a.ptr)
        if raw is not None:
            return raw
        if self.args is None or a.ptr % 16:   # (a misaligned address gets encode_args' error)
            self.args = encode_args(a, self.box, self.swizzle)
        data_type, dims, strides, rbox, swz, l2 = self.args
        raw = _driver.encode_tiled(data_type, a.ptr, dims, strides, rbox, swz, l2)
        if len(self.recent) >= self.RECENT:
            self.recent.clear()
        self.recent[a.ptr] = raw
        return raw
