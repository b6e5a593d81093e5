"""Cross-entropy's NumPy references (float64)."""
from __future__ import annotations

import numpy as np

from .. import _arrays
from .checks import Options, _check_backward, _check_rows, _loss_shape, _options
from .configs import INDEX_CTYPES
from .linear import _check_linear
from .loss import _check_dloss, _loss_dtype

# ---- NumPy references ------------------------------------------------------------------------

def _reference_rows(logits, target, opts: Options):
    la = _arrays.as_host_array(logits, "logits")
    ta = _arrays.as_host_array(target, "target", tuple(INDEX_CTYPES))
    _check_rows(la, ta)
    v = la.shape[-1]
    x = la.obj.astype(np.float64).reshape(-1, v)
    t = ta.obj.astype(np.int64).reshape(-1)
    bad = (t != opts.ignore_index) & ((t < 0) | (t >= v))
    if bad.any():
        value = int(t[bad][0])
        raise IndexError(f"target: class {value} is out of range for {v} classes (valid: 0 to {v - 1}, "
                         "or ignore_index)")
    z = opts.softcap * np.tanh(x / opts.softcap) if opts.softcap else x
    with np.errstate(all="ignore"):
        m = np.max(z, axis=1, keepdims=True)
        m = np.where(np.isfinite(m), m, 0.0)
        lse = (np.log(np.sum(np.exp(z - m), axis=1, keepdims=True)) + m)[:, 0]
    keep = t != opts.ignore_index
    return la, ta, x, z, t, lse, keep


def _reference_loss_rows(z, t, lse, keep, opts: Options, v: int):
    zt = np.where(keep, z[np.arange(len(t)), np.where(keep, t, 0)], 0.0)
    with np.errstate(all="ignore"):
        loss = lse - (1.0 - opts.smoothing) * zt + opts.z_loss * lse * lse
        if opts.smoothing:
            loss = loss - opts.smoothing / v * np.sum(z, axis=1)
    return np.where(keep, loss, 0.0)


def reference_cross_entropy(logits, target, *, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None,
                            reduction="mean", return_lse=False, loss_dtype=None):
    """``cross_entropy`` in float64 (an out-of-range target raises IndexError at once)."""
    opts = _options(ignore_index, label_smoothing, z_loss, softcap, reduction)
    la, ta, x, z, t, lse, keep = _reference_rows(logits, target, opts)
    if la.dtype != "float64":
        _loss_dtype(loss_dtype, la)
    rows = _reference_loss_rows(z, t, lse, keep, opts, la.shape[-1])
    with np.errstate(all="ignore"):
        if reduction == "none":
            loss = rows.reshape(ta.shape)
        elif reduction == "sum":
            loss = np.float64(rows.sum())
        else:
            loss = np.float64(rows.sum() / keep.sum())
    return (loss, lse.reshape(ta.shape)) if return_lse else loss


def reference_cross_entropy_backward(dloss, logits, target, lse, *, ignore_index=-100, label_smoothing=0.0,
                                     z_loss=0.0, softcap=None, reduction="mean"):
    """``cross_entropy_backward`` in float64 (``lse`` is checked, then recomputed)."""
    opts = _options(ignore_index, label_smoothing, z_loss, softcap, reduction)
    la, ta, x, z, t, lse_, keep = _reference_rows(logits, target, opts)
    v = la.shape[-1]
    da = _arrays.as_host_array(dloss, "dloss")
    if da.dtype != "float64":
        _check_dloss(da, la, _loss_shape(ta, reduction))
    elif da.shape != _loss_shape(ta, reduction):
        raise ValueError(f"dloss: shape {da.shape} does not match the loss's {_loss_shape(ta, reduction)}")
    _check_backward(_arrays.as_host_array(lse, "lse", ("float32",)), ta)
    g = np.broadcast_to(da.obj.astype(np.float64).reshape(-1), (len(t),)).copy()
    if reduction == "mean":
        g = g / keep.sum()
    with np.errstate(all="ignore"):
        p = np.exp(z - lse_[:, None])
        dz = p * (1.0 + 2.0 * opts.z_loss * lse_[:, None]) - opts.smoothing / v
        idx = np.nonzero(keep)[0]
        dz[idx, t[idx]] -= 1.0 - opts.smoothing
        if opts.softcap:
            dz = dz * (1.0 - (z / opts.softcap) ** 2)
        dx = np.where(keep[:, None], g[:, None] * dz, 0.0)
    return dx.reshape(la.shape)


def reference_cross_entropy_forward_backward(logits, target, *, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                                             softcap=None, reduction="mean", inplace=False, return_lse=False,
                                             loss_dtype=None):
    """``cross_entropy_forward_backward`` in float64 (``inplace`` is accepted and ignored)."""
    kw = dict(ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
              reduction=reduction)
    loss, lse = reference_cross_entropy(logits, target, return_lse=True, loss_dtype=loss_dtype, **kw)
    one = np.ones(np.shape(loss))
    d = reference_cross_entropy_backward(one, logits, target, lse.astype(np.float32), **kw)
    return (loss, d, lse) if return_lse else (loss, d)


def _reference_linear(hidden, weight, target, bias):
    ha, wa = _arrays.as_host_array(hidden, "hidden"), _arrays.as_host_array(weight, "weight")
    ta = _arrays.as_host_array(target, "target", tuple(INDEX_CTYPES))
    ba = None if bias is None else _arrays.as_host_array(bias, "bias")
    _check_linear(ha, wa, ta, ba)
    h = ha.obj.astype(np.float64).reshape(-1, ha.shape[-1])
    w = wa.obj.astype(np.float64)
    logits = h @ w.T + (0.0 if ba is None else ba.obj.astype(np.float64))
    return ha, ta, h, w, logits


def reference_linear_cross_entropy(hidden, weight, target, bias=None, *, ignore_index=-100, label_smoothing=0.0,
                                   z_loss=0.0, softcap=None, reduction="mean", loss_dtype=None):
    """``linear_cross_entropy`` in float64: the loss of the full logits."""
    ha, ta, h, w, logits = _reference_linear(hidden, weight, target, bias)
    if ha.dtype != "float64":
        _loss_dtype(loss_dtype, ha)
    loss = reference_cross_entropy(logits, ta.obj.reshape(-1), ignore_index=ignore_index,
                                   label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap, reduction=reduction)
    return loss.reshape(ta.shape) if reduction == "none" else loss


def reference_linear_cross_entropy_forward_backward(hidden, weight, target, bias=None, *, ignore_index=-100,
                                                    label_smoothing=0.0, z_loss=0.0, softcap=None, reduction="mean",
                                                    loss_dtype=None):
    """``linear_cross_entropy_forward_backward`` in float64: (loss, dhidden, dweight, dbias)."""
    if reduction == "none":
        raise ValueError("reduction: the training form of linear_cross_entropy takes 'mean' or 'sum'")
    ha, ta, h, w, logits = _reference_linear(hidden, weight, target, bias)
    kw = dict(ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
              reduction=reduction)
    loss, d = reference_cross_entropy_forward_backward(logits, ta.obj.reshape(-1), **kw)
    return loss, (d @ w).reshape(ha.shape), d.T @ h, (None if bias is None else d.sum(0))
