"""The norms' NumPy references (float64; the oracle of the tests)."""
from __future__ import annotations

import numpy as np

from .. import _arrays
from .._arrays import DeviceArray
from .checks import _check_backward, _check_forward
from .forward import _casting, _check_fp8, _offset, _out_dtype, _scalar

# ---- NumPy references (float64; the oracle of the tests) -------------------------------------

def _host(obj, name, dtypes=_arrays.FLOATS):
    """An optional array (weight, bias, residual): None stays None."""
    return None if obj is None else _arrays.as_host_array(obj, name, dtypes)


def _f64(a: DeviceArray | None):
    return None if a is None else a.obj.astype(np.float64)


def _ref_input(xa, ra):
    """(normalized input, h): h = x + residual rounded to x's dtype, or (x, None)."""
    if ra is None:
        return _f64(xa), None
    h = (_f64(xa) + _f64(ra)).astype(xa.obj.dtype).astype(np.float64)
    return h, h


def _ref_fp8(y, xa, out_dtype, scale, amax, cast=0):
    """The fp8 output of float64 ``y``: saturate(y * scale) rounded to nearest even (ml_dtypes),
    max |y| written into ``amax`` when given; y itself without an fp8 out_dtype."""
    out = _out_dtype(out_dtype, xa)
    sa = None if scale is None else _scalar(scale, "scale", host=True)
    aa = None if amax is None else _scalar(amax, "amax", host=True)
    _check_fp8(out, sa, aa, cast)
    if out is None:
        return y
    import ml_dtypes

    big = float(ml_dtypes.finfo(getattr(ml_dtypes, out)).max)
    if aa is not None:
        aa.obj.reshape(-1)[0] = np.abs(y).max(initial=0.0) if not np.isnan(y).any() else np.nan
    with np.errstate(invalid="ignore"):
        scaled = np.clip(y * float(sa.obj.reshape(-1)[0]), -big, big)
    return scaled.astype(getattr(ml_dtypes, out))


def reference_layer_norm(x, weight=None, bias=None, eps=1e-5, *, residual=None, return_stats=False, offset=0.0,
                         out_dtype=None, scale=None, amax=None):
    """``layer_norm`` in float64 from the given (rounded) values: the same arguments, checks
    and outputs (float64 arrays; an fp8 y as an ml_dtypes array, its amax written into
    ``amax``, a NumPy array of one float32)."""
    xa, ra = _arrays.as_host_array(x, "x"), _host(residual, "residual")
    wa, ba = _host(weight, "weight"), _host(bias, "bias")
    e = _check_forward(xa, wa, ba, ra, eps)
    off = _offset(offset, weight)
    v, h = _ref_input(xa, ra)
    mean = v.mean(axis=-1)
    var = ((v - mean[..., None]) ** 2).mean(axis=-1)
    rstd = 1.0 / np.sqrt(var + e)
    y = (v - mean[..., None]) * rstd[..., None]
    if wa is not None:
        y = y * (_f64(wa) + off)
    if ba is not None:
        y = y + _f64(ba)
    y = _ref_fp8(y, xa, out_dtype, scale, amax)
    out = [y] + ([h] if h is not None else []) + ([mean, rstd] if return_stats else [])
    return out[0] if len(out) == 1 else tuple(out)


def _rounder(xa, cast: int):
    """Rounding to x's dtype where the casting mode rounds (nothing for float32 or "gemma")."""
    if not cast or xa.dtype in ("float32", "float64"):
        return lambda a: a
    t = _arrays._np_dtype(xa.dtype)
    return lambda a: np.asarray(a).astype(t).astype(np.float64)


def reference_rms_norm(x, weight=None, eps=1e-6, *, residual=None, return_stats=False, offset=0.0,
                       casting_mode="gemma", out_dtype=None, scale=None, amax=None):
    """``rms_norm`` in float64 (see ``reference_layer_norm``); the casting modes round to x's
    dtype where the kernels do."""
    xa, wa, ra = _arrays.as_host_array(x, "x"), _host(weight, "weight"), _host(residual, "residual")
    e = _check_forward(xa, wa, None, ra, eps)
    off = _offset(offset, weight)
    cast = _casting(casting_mode, True)
    rnd = _rounder(xa, cast)
    v, h = _ref_input(xa, ra)
    rstd = 1.0 / np.sqrt((v * v).mean(axis=-1) + e)
    if cast == 2:
        rstd = rnd(rstd)
    y = rnd(v * rstd[..., None])
    if wa is not None:
        y = y * (_f64(wa) + off)
    y = _ref_fp8(y, xa, out_dtype, scale, amax, cast)
    out = [y] + ([h] if h is not None else []) + ([rstd] if return_stats else [])
    return out[0] if len(out) == 1 else tuple(out)


def _ref_backward(rms, dy, x, weight, mean, rstd, dresidual, offset=0.0, casting_mode="gemma"):
    da, xa, wa = _arrays.as_host_array(dy, "dy"), _arrays.as_host_array(x, "x"), _host(weight, "weight")
    ma = None if rms else _arrays.as_host_array(mean, "mean", ("float32",))
    sa, dra = _arrays.as_host_array(rstd, "rstd", ("float32",)), _host(dresidual, "dresidual")
    _check_backward(da, xa, wa, ma, sa, dra, rms)
    off = _offset(offset, weight)
    rnd = _rounder(xa, _casting(casting_mode, rms))
    g, v = _f64(da), _f64(xa)
    d = v.shape[-1]
    rs = _f64(sa).reshape(v.shape[:-1])[..., None]
    mu = 0.0 if rms else _f64(ma).reshape(v.shape[:-1])[..., None]
    xhat = (v - mu) * rs
    gw = rnd(g * (_f64(wa) + off)) if wa is not None else g
    c = (gw * xhat).sum(axis=-1, keepdims=True) / max(d, 1)
    a = 0.0 if rms else gw.sum(axis=-1, keepdims=True) / max(d, 1)
    dx = rs * (gw - a - xhat * c)
    if dra is not None:
        dx = dx + _f64(dra)
    lead = tuple(range(v.ndim - 1))
    dw = (g * rnd(xhat)).sum(axis=lead) if wa is not None else None
    return dx, dw, g.sum(axis=lead)


def reference_layer_norm_backward(dy, x, weight, mean, rstd, *, dresidual=None, offset=0.0):
    """``layer_norm_backward`` in float64: ``(dx, dweight or None, dbias)``."""
    return _ref_backward(False, dy, x, weight, mean, rstd, dresidual, offset)


def reference_rms_norm_backward(dy, x, weight, rstd, *, dresidual=None, offset=0.0, casting_mode="gemma"):
    """``rms_norm_backward`` in float64: ``(dx, dweight or None)``."""
    dx, dw, _ = _ref_backward(True, dy, x, weight, None, rstd, dresidual, offset, casting_mode)
    return dx, dw
