"""NumPy references of every op, computed in float64: the oracle of the tests.

They take NumPy arrays of any float dtype (bfloat16 through ``ml_dtypes``), compute in float64
from the values as given (already rounded to their dtype), and return float64 arrays, so a
test measures the kernel's whole error. Signatures mirror the CUDA ops; the fused residual
add is rounded to the input dtype before the norm, as the kernels (and an unfused add) do.
"""
from __future__ import annotations

import numpy as np

__all__ = ["layer_norm", "rms_norm", "layer_norm_backward", "rms_norm_backward", "round_to"]


def _f64(a):
    return None if a is None else np.asarray(a).astype(np.float64)


def round_to(a, dtype):
    """``a`` rounded to ``dtype`` (round to nearest even), returned as float64."""
    return np.asarray(a).astype(dtype).astype(np.float64)


def _residual(x, residual):
    """(normalized input, h): h = x + residual rounded to x's dtype, or (x, None)."""
    if residual is None:
        return _f64(x), None
    h = round_to(_f64(x) + _f64(residual), np.asarray(x).dtype)
    return h, h


def layer_norm(x, weight=None, bias=None, eps=1e-5, *, residual=None, return_stats=False):
    """(*, D) -> y (*, D); with residual (y, h); with return_stats (..., mean, rstd)."""
    v, h = _residual(x, residual)
    mean = v.mean(axis=-1)
    var = ((v - mean[..., None]) ** 2).mean(axis=-1)
    rstd = 1.0 / np.sqrt(var + eps)
    y = (v - mean[..., None]) * rstd[..., None]
    if weight is not None:
        y = y * _f64(weight)
    if bias is not None:
        y = y + _f64(bias)
    out = [y] + ([h] if h is not None else []) + ([mean, rstd] if return_stats else [])
    return out[0] if len(out) == 1 else tuple(out)


def rms_norm(x, weight=None, eps=1e-6, *, residual=None, return_stats=False):
    """(*, D) -> y (*, D); with residual (y, h); with return_stats (..., rstd)."""
    v, h = _residual(x, residual)
    rstd = 1.0 / np.sqrt((v * v).mean(axis=-1) + eps)
    y = v * rstd[..., None]
    if weight is not None:
        y = y * _f64(weight)
    out = [y] + ([h] if h is not None else []) + ([rstd] if return_stats else [])
    return out[0] if len(out) == 1 else tuple(out)


def _norm_backward(dy, x, weight, mean, rstd, dresidual):
    dy, x = _f64(dy), _f64(x)
    d = x.shape[-1]
    rstd = _f64(rstd).reshape(x.shape[:-1])[..., None]
    mu = 0.0 if mean is None else _f64(mean).reshape(x.shape[:-1])[..., None]
    xhat = (x - mu) * rstd
    g = dy * _f64(weight) if weight is not None else dy
    c = (g * xhat).sum(axis=-1, keepdims=True) / d
    a = 0.0 if mean is None else g.sum(axis=-1, keepdims=True) / d
    dx = rstd * (g - a - xhat * c)
    if dresidual is not None:
        dx = dx + _f64(dresidual)
    lead = tuple(range(x.ndim - 1))
    dw = (dy * xhat).sum(axis=lead) if weight is not None else None
    db = dy.sum(axis=lead)
    return dx, dw, db


def layer_norm_backward(dy, x, weight, mean, rstd, *, dresidual=None):
    """-> (dx, dweight or None, dbias), from the forward's statistics."""
    return _norm_backward(dy, x, weight, mean, rstd, dresidual)


def rms_norm_backward(dy, x, weight, rstd, *, dresidual=None):
    """-> (dx, dweight or None)."""
    dx, dw, _ = _norm_backward(dy, x, weight, None, rstd, dresidual)
    return dx, dw
