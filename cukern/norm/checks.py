"""The norms' argument checks, shared by the kernels' front and the references."""
from __future__ import annotations

import math

from .. import _arrays, _checks
from .._arrays import DeviceArray

# ---- argument checks (kernels and references alike) -----------------------------------------

def _check_forward(xa: DeviceArray, wa, ba, ra, eps) -> float:
    if xa.ndim < 1:
        raise ValueError(f"{xa.name}: must have at least one axis (the normalized one), got a scalar")
    cols = xa.shape[-1]
    _checks.like(wa, xa, (cols,))
    _checks.like(ba, xa, (cols,))
    _checks.like(ra, xa, xa.shape)
    return _checks.eps(eps)


def _check_stats(a: DeviceArray | None, xa: DeviceArray) -> DeviceArray | None:
    if a is None:
        return None
    lead = tuple(xa.shape[:-1])
    if a.shape not in (lead, lead + (1,)) and not (a.ndim == 1 and a.shape[0] == math.prod(lead)):
        raise ValueError(f"{a.name}: shape {a.shape} does not match {xa.name}'s leading shape {lead}")
    return a


def _check_backward(da: DeviceArray, xa: DeviceArray, wa, ma, sa, dra, rms: bool) -> None:
    if da.ndim < 1:
        raise ValueError(f"{da.name}: must have at least one axis (the normalized one), got a scalar")
    _checks.like(xa, da, da.shape)
    _checks.like(wa, xa, (xa.shape[-1],))
    if not rms:
        _check_stats(ma, xa)
    _check_stats(sa, xa)
    _checks.like(dra, xa, xa.shape)


def _optional(obj, name: str, dtypes=_arrays.FLOATS):
    return None if obj is None else _arrays.as_device_array(obj, name, dtypes)
