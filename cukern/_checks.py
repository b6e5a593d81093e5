"""Argument checks shared by the families' fronts and their NumPy references.

Each takes arrays already converted to a ``DeviceArray`` view (``_arrays.as_device_array`` for
the kernels, ``_arrays.as_host_array`` for the references), so one check gives one message
whichever side runs it. Every message starts with the argument's name.
"""
from __future__ import annotations

import math
import operator

import numpy as np

from ._arrays import DeviceArray

__all__ = ["like", "eps", "index", "positive_float32", "softcap"]


def like(a: DeviceArray | None, ref: DeviceArray, shape) -> DeviceArray | None:
    """``a`` has ``shape`` and ``ref``'s dtype (None passes)."""
    if a is None:
        return None
    if a.shape != tuple(shape):
        raise ValueError(f"{a.name}: shape {a.shape} does not match {tuple(shape)} (from {ref.name} {ref.shape})")
    if a.dtype != ref.dtype and not (a.kind == "numpy" and "float64" in (a.dtype, ref.dtype)):
        # (the references take float64 beside any dtype: their own results feed their backwards)
        raise ValueError(f"{a.name}: dtype {a.dtype} differs from {ref.name}'s {ref.dtype}; "
                         "cast it so that all inputs share one dtype")
    return a


def _number(value, name: str) -> float:
    """``value`` as a float: a real number (not a bool, not a string)."""
    if isinstance(value, (str, bytes, bool, np.bool_)):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__}") from None


def eps(value, name: str = "eps") -> float:
    """A finite, non-negative number."""
    e = _number(value, name)
    if not math.isfinite(e) or e < 0:
        raise ValueError(f"{name}: must be finite and non-negative, got {value}")
    return e


def index(value, name: str) -> int:
    """An integer (Python or NumPy; not a bool, not a float)."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected an int, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type(value).__name__}") from None


def positive_float32(value, name: str, *, log2e: bool = False) -> float:
    """A finite positive number that stays a normal float32 (also times log2(e) when asked)."""
    s = _number(value, name)
    if not (math.isfinite(s) and s > 0):
        raise ValueError(f"{name}: must be finite and positive, got {value}")
    tiny, big = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)
    top = big / 1.4426950408889634 if log2e else big
    if not tiny <= s <= top:
        raise ValueError(f"{name}: {value} is outside float32's normal range [{tiny:.3g}, {top:.3g}]")
    return s


def softcap(value, name: str = "softcap", *, log2e: bool = False) -> float:
    """A logit softcap: None and 0 both mean none (0.0), as every function taking one agrees;
    otherwise a positive number that stays a normal float32 (also times log2(e) when asked)."""
    if value is None:
        return 0.0
    c = eps(value, name)
    return positive_float32(c, name, log2e=log2e) if c else 0.0
