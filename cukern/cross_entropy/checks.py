"""Cross-entropy's argument checks, shared by the kernels' front and the references."""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from .. import _arrays, _checks
from .._arrays import DeviceArray
from .._plans import Builder
from .configs import INDEX_CTYPES, REDUCTIONS

# ---- argument checks (kernels and references alike) -----------------------------------------

@dataclass(frozen=True)
class Options:
    """The checked scalar options of a call (part of its plan's key)."""
    ignore_index: int
    smoothing: float
    z_loss: float
    softcap: float   # 0: none
    reduction: str


class Flags(NamedTuple):
    """What a call of the row kernel's front asks for, besides the options (part of its plan's
    key: a tuple, hashed as one)."""
    return_lse: bool = False
    inplace: bool = False           # the training form's gradient over the logits
    loss_dtype: str = "float32"
    shared_count: bool = False      # the count of kept rows given (linear cross-entropy's chunks)
    donate: bool = False            # the backward's gradient over the unit gradient


def _options(ignore_index, label_smoothing, z_loss, softcap, reduction) -> Options:
    ignore = _checks.index(ignore_index, "ignore_index")
    if not -2**63 <= ignore < 2**63:
        raise ValueError(f"ignore_index: {ignore} does not fit in int64")
    smoothing = _checks.eps(label_smoothing, "label_smoothing")
    if smoothing > 1.0:
        raise ValueError(f"label_smoothing: must be in [0, 1], got {label_smoothing}")
    z = _checks.eps(z_loss, "z_loss")
    cap = _checks.softcap(softcap)
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction: must be one of {', '.join(map(repr, REDUCTIONS))}, got {reduction!r}")
    return Options(ignore, smoothing, z, cap, reduction)


def _check_rows(la: DeviceArray, ta: DeviceArray) -> None:
    if la.ndim < 1:
        raise ValueError(f"{la.name}: must have at least one axis (the classes, last), got a scalar")
    if la.shape[-1] < 1:
        raise ValueError(f"{la.name}: the class axis (last) is empty: shape {la.shape}")
    if ta.shape != la.shape[:-1]:
        raise ValueError(f"{ta.name}: shape {ta.shape} does not match the leading shape of {la.name}, {la.shape[:-1]}")


def _loss_shape(ta: DeviceArray, reduction: str) -> tuple:
    return ta.shape if reduction == "none" else ()


def _check_backward(sa: DeviceArray, ta: DeviceArray) -> None:
    if sa.dtype not in ("float32", "float64") or sa.shape != ta.shape:
        raise ValueError(f"{sa.name}: must be float32 of shape {ta.shape} (the forward's lse), "
                         f"got {sa.dtype} {sa.shape}")


def _target(obj) -> DeviceArray:
    return _arrays.as_device_array(obj, "target", tuple(INDEX_CTYPES))


def _vector_width(la: DeviceArray, stride: int, d_stride: int) -> int:
    """16-byte vectors when every row of the logits (and of the gradient, whose new buffers are
    aligned, and which in place shares the logits' rows) starts 16-byte aligned."""
    vec = 16 // la.itemsize
    if la.shape[-1] % vec or stride % vec or d_stride % vec or la.ptr % 16:
        return 1
    return vec


def _rows_layout(b: Builder, slot: int, la: DeviceArray) -> int:
    """The row stride the kernels read ``la`` with; a contiguous copy when its rows cannot be
    read as one strided axis with unit-stride classes."""
    stride = la.row_stride()
    if stride is None or la.ndim == 1:
        if stride is None:
            b.fix(slot, DeviceArray.contiguous)
        return la.shape[-1]
    return stride
