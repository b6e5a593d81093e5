"""NumPy references of every op, computed in float64: the oracle of the tests.

They take NumPy arrays of any float dtype (bfloat16 through ``ml_dtypes``), compute in float64
from the values as given (already rounded to their dtype), and return float64 arrays, so a
test measures the kernel's whole error. Signatures mirror the CUDA ops; the fused residual
add is rounded to the input dtype before the norm, as the kernels (and an unfused add) do.
"""
from __future__ import annotations

import numpy as np

__all__ = ["layer_norm", "rms_norm", "layer_norm_backward", "rms_norm_backward", "group_norm",
           "group_norm_backward", "embedding", "embedding_backward", "round_to"]


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


# ---- group norm ------------------------------------------------------------------------------

def _grouped(x, num_groups):
    """(N, C, *S) -> float64 (N, G, C/G * prod(S)): one row a (sample, group)."""
    x = _f64(x)
    n, c = x.shape[:2]
    if c % num_groups:
        raise ValueError(f"num_groups: {c} channels are not divisible by {num_groups}")
    return x.reshape(n, num_groups, -1)


def _per_channel(p, shape):
    """(C,) -> broadcastable against (N, C, *S)."""
    return _f64(p).reshape((1, shape[1]) + (1,) * (len(shape) - 2))


def group_norm(x, num_groups, weight=None, bias=None, eps=1e-5, *, return_stats=False):
    """(N, C, *S) -> y; with return_stats (y, mean, rstd), stats (N, num_groups)."""
    shape = np.shape(x)
    v = _grouped(x, num_groups)
    mean = v.mean(axis=-1)
    var = ((v - mean[..., None]) ** 2).mean(axis=-1)
    rstd = 1.0 / np.sqrt(var + eps)
    y = ((v - mean[..., None]) * rstd[..., None]).reshape(shape)
    if weight is not None:
        y = y * _per_channel(weight, shape)
    if bias is not None:
        y = y + _per_channel(bias, shape)
    return (y, mean, rstd) if return_stats else y


def group_norm_backward(dy, x, num_groups, weight, mean, rstd):
    """-> (dx, dweight or None, dbias), from the forward's statistics."""
    shape = np.shape(x)
    n = shape[0]
    v = _grouped(x, num_groups)
    mu = _f64(mean).reshape(n, num_groups, 1)
    rs = _f64(rstd).reshape(n, num_groups, 1)
    xhat = (v - mu) * rs
    dy = _f64(dy)
    g = (dy * _per_channel(weight, shape) if weight is not None else dy).reshape(v.shape)
    m = v.shape[-1]
    dx = rs * (g - g.sum(axis=-1, keepdims=True) / m
               - xhat * (g * xhat).sum(axis=-1, keepdims=True) / m)
    axes = (0,) + tuple(range(2, len(shape)))
    dw = (dy * xhat.reshape(shape)).sum(axis=axes) if weight is not None else None
    db = dy.sum(axis=axes)
    return dx.reshape(shape), dw, db


# ---- embedding --------------------------------------------------------------------------------

def _indices(indices, num_embeddings: int) -> np.ndarray:
    """``indices`` as an integer NumPy array, every value in [0, num_embeddings); IndexError
    (message "indices: ...") naming the first bad value otherwise. NumPy would wrap negative
    values; the op does not, so neither does the reference."""
    idx = np.asarray(indices)
    if idx.dtype.kind not in "iu":
        raise ValueError(f"indices: dtype {idx.dtype} is not an integer type (expected int32 or int64)")
    bad = (idx < 0) | (idx >= num_embeddings)
    if bad.any():
        value = int(idx[bad].flat[0])
        raise IndexError(f"indices: index {value} is out of range for an embedding of "
                         f"{num_embeddings} rows (expected 0 <= index < {num_embeddings})")
    return idx.astype(np.int64)


def _padding_idx(padding_idx, num_embeddings: int):
    """The row whose gradient is zero (negative values count from the end, as torch), or None."""
    if padding_idx is None:
        return None
    p = int(padding_idx)
    if not -num_embeddings <= p < num_embeddings:
        raise ValueError(f"padding_idx: {padding_idx} is out of range for an embedding of "
                         f"{num_embeddings} rows (expected {-num_embeddings} <= padding_idx < {num_embeddings})")
    return p + num_embeddings if p < 0 else p


def embedding(indices, weight, padding_idx=None):
    """Rows of ``weight`` picked by ``indices``, as ``torch.nn.functional.embedding``.

    Args:
        indices: integer array of any shape (0-d and empty included); every value must be in
            [0, V). Out-of-range values raise IndexError ("indices: ..."); negative values are
            not wrapped.
        weight: (V, D) of any float dtype.
        padding_idx: None or -V <= padding_idx < V (ValueError otherwise). It does not change
            the forward (the padding row is looked up like any other); it is only validated.

    Returns:
        float64 array of shape (*indices.shape, D): ``weight[indices]``.
    """
    w = _f64(weight)
    if w.ndim != 2:
        raise ValueError(f"weight: expected a 2-D (num_embeddings, embedding_dim) array, got shape {w.shape}")
    _padding_idx(padding_idx, w.shape[0])
    idx = _indices(indices, w.shape[0])
    return w[idx]


def embedding_backward(grad, indices, num_embeddings, padding_idx=None, scale_grad_by_freq=False):
    """Gradient of ``embedding`` with respect to its (V, D) weight, as torch's autograd gives it.

    Args:
        grad: (*indices.shape, D) gradient of the embedding's output, any float dtype.
        indices: integer array, values in [0, num_embeddings) (IndexError otherwise).
        num_embeddings: V, the number of rows of the weight (an int >= 1).
        padding_idx: None or -V <= padding_idx < V; that row's gradient is zero.
        scale_grad_by_freq: divide each row's summed gradient by the number of times its index
            occurs in ``indices``.

    Returns:
        float64 (V, D): row v is the sum (np.add.at, float64) of the ``grad`` rows whose index
        is v; zero for rows never looked up and for the padding row.
    """
    if isinstance(num_embeddings, (bool, np.bool_)) or not isinstance(num_embeddings, (int, np.integer)):
        raise ValueError(f"num_embeddings: expected an int, got {type(num_embeddings).__name__}")
    v = int(num_embeddings)
    if v < 1:
        raise ValueError(f"num_embeddings: must be at least 1, got {v}")
    pad = _padding_idx(padding_idx, v)
    idx = _indices(indices, v)
    g = _f64(grad)
    if g.ndim != idx.ndim + 1 or g.shape[:-1] != idx.shape:
        raise ValueError(f"grad: shape {g.shape} does not match indices.shape + (D,) "
                         f"with indices.shape {idx.shape}")
    d = g.shape[-1]
    flat, rows = idx.reshape(-1), g.reshape(-1, d)
    out = np.zeros((v, d), np.float64)
    np.add.at(out, flat, rows)
    if scale_grad_by_freq:
        counts = np.bincount(flat, minlength=v).astype(np.float64)
        out /= np.maximum(counts, 1.0)[:, None]
    if pad is not None:
        out[pad] = 0.0
    return out


# ---- attention --------------------------------------------------------------------------------

__all__ += ["attention"]


def attention(q, k, v, *, causal=False, softmax_scale=None, return_lse=False):
    """q (B, Sq, H, D), k and v (B, Sk, Hkv, D) -> out (B, Sq, H, D) [, lse (B, H, Sq)].

    Causal masking aligned to the bottom right (query i sees keys j <= i + Sk - Sq); a query
    that sees no key gives zeros and lse = +inf (as the kernel)."""
    q, k, v = _f64(q), _f64(k), _f64(v)
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    scale = 1.0 / np.sqrt(D) if softmax_scale is None else float(softmax_scale)
    rep = H // Hkv
    kh = np.repeat(k, rep, axis=2)  # (B, Sk, H, D): query head h reads kv head h // rep
    vh = np.repeat(v, rep, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, kh) * scale
    if causal:
        keep = np.arange(Sk)[None, :] <= np.arange(Sq)[:, None] + (Sk - Sq)
        s = np.where(keep[None, None], s, -np.inf)
    with np.errstate(invalid="ignore", divide="ignore"):
        m = s.max(axis=-1, keepdims=True) if Sk else np.full(s.shape[:-1] + (1,), -np.inf)
        m_safe = np.where(np.isfinite(m), m, 0.0)
        p = np.exp(s - m_safe)
        l = p.sum(axis=-1, keepdims=True)
        out = np.einsum("bhqk,bkhd->bqhd", np.where(l > 0, p / np.where(l > 0, l, 1.0), 0.0), vh)
        lse = np.where(l[..., 0] > 0, np.log(np.where(l[..., 0] > 0, l[..., 0], 1.0)) + m_safe[..., 0], np.inf)
    return (out, lse) if return_lse else out


__all__ += ["attention_backward"]


def attention_backward(dout, q, k, v, *, causal=False, softmax_scale=None):
    """-> (dq, dk, dv) in float64; dk and dv summed over the query heads sharing a K/V head."""
    q, k, v, dout = _f64(q), _f64(k), _f64(v), _f64(dout)
    B, Sq, H, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    scale = 1.0 / np.sqrt(D) if softmax_scale is None else float(softmax_scale)
    rep = H // Hkv
    kh, vh = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
    s = np.einsum("bqhd,bkhd->bhqk", q, kh) * scale
    if causal:
        keep = np.arange(Sk)[None, :] <= np.arange(Sq)[:, None] + (Sk - Sq)
        s = np.where(keep[None, None], s, -np.inf)
    with np.errstate(invalid="ignore"):
        m = s.max(axis=-1, keepdims=True)
        m = np.where(np.isfinite(m), m, 0.0)
        p = np.exp(s - m)
        l = p.sum(axis=-1, keepdims=True)
        p = np.where(l > 0, p / np.where(l > 0, l, 1.0), 0.0)
    dvh = np.einsum("bhqk,bqhd->bkhd", p, dout)
    dp = np.einsum("bqhd,bkhd->bhqk", dout, vh)
    ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True))
    dq = np.einsum("bhqk,bkhd->bqhd", ds, kh) * scale
    dkh = np.einsum("bhqk,bqhd->bkhd", ds, q) * scale
    dk = dkh.reshape(B, Sk, Hkv, rep, D).sum(axis=3)
    dv = dvh.reshape(B, Sk, Hkv, rep, D).sum(axis=3)
    return dq, dk, dv
