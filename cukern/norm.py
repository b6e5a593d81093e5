"""LayerNorm and RMSNorm over the last axis, forward and backward (kernels: cuda_src/norm.cu).

Shapes: ``x`` is (*, D); the norm is taken over D. ``weight`` and ``bias`` are (D,).
dtypes: float32, float16, bfloat16 — every array argument of one call has the same dtype;
statistics (mean, rstd) are float32 of shape x.shape[:-1]. Arithmetic is float32.
"""
from __future__ import annotations

import math

import numpy as np

from . import _arrays, _kernels, _partials
from ._arrays import DeviceArray

__all__ = ["layer_norm", "rms_norm", "layer_norm_backward", "rms_norm_backward"]

SOURCE = "norm.cu"

# Row-in-registers configurations (NV, G, THREADS, R, MINB): a thread holds NV vectors of a
# row, G threads own a row, a block has THREADS threads, a group takes R rows at a time, and
# ptxas is asked to fit MINB blocks an SM (which sets the register budget). In order of
# capacity NV*G vectors; the first that holds the row is used, wider rows take the looped
# kernels. Chosen by measurement (docs/notes-norm.md); none spills (tests/test_compile.py).
FWD_CONFIGS = ((1, 4, 128, 1, 1), (1, 16, 128, 1, 1), (1, 32, 128, 2, 1), (2, 32, 128, 2, 1),
               (4, 32, 128, 1, 1), (2, 128, 128, 1, 1), (4, 128, 128, 1, 7), (4, 256, 256, 1, 1),
               (4, 512, 512, 1, 1))
BWD_CONFIGS = ((1, 4, 128, 1, 1), (1, 16, 128, 1, 1), (1, 32, 128, 1, 1), (2, 32, 128, 1, 1),
               (4, 32, 128, 1, 1), (2, 128, 128, 1, 1), (4, 128, 128, 1, 1), (4, 256, 256, 1, 1))
LOOP_THREADS = 512


def _vector_width(itemsize: int, cols: int, arrays) -> int:
    """16-byte vectors when every row of every array starts 16-byte aligned, else scalars."""
    vec = 16 // itemsize
    if cols % vec:
        return 1
    for a, stride in arrays:
        if a is not None and (a.ptr % 16 or stride % vec):
            return 1
    return vec


def _instance(kind: str, configs, ctype: str, rms: bool, vec: int, cols: int):
    """(instance name, threads, rows a block takes per step, row groups a block) for rows of
    ``cols``; ``kind`` is "fwd" or "bwd"."""
    nvec = -(-cols // vec)
    rmsb = "true" if rms else "false"
    for nv, g, threads, r, minb in configs:
        if nv * g >= nvec:
            name = f"norm_{kind}<{ctype}, {rmsb}, {vec}, {nv}, {g}, {threads}, {r}, {minb}>"
            return name, threads, threads // g * r, threads // g
    return f"norm_{kind}_loop<{ctype}, {rmsb}, {vec}, {LOOP_THREADS}>", LOOP_THREADS, 1, 1


def instances() -> list[str]:
    """Every kernel instance the fronts below can launch (for the compile check)."""
    names = []
    for ctype, itemsize in _arrays.DTYPES.values():
        for rms in (False, True):
            rmsb = "true" if rms else "false"
            for vec in sorted({1, 16 // itemsize}):
                for kind, configs in (("fwd", FWD_CONFIGS), ("bwd", BWD_CONFIGS)):
                    names += [f"norm_{kind}<{ctype}, {rmsb}, {vec}, {nv}, {g}, {t}, {r}, {m}>"
                              for nv, g, t, r, m in configs]
                    names.append(f"norm_{kind}_loop<{ctype}, {rmsb}, {vec}, {LOOP_THREADS}>")
    return names


# ---- argument checking ----------------------------------------------------------------------

def _rows_view(a: DeviceArray) -> tuple[DeviceArray, int]:
    """(array, row stride) with the last axis unit-stride; copies only when it must."""
    stride = a.row_stride()
    if stride is None:
        a = a.contiguous()
        stride = a.shape[-1]
    return a, stride


def _check_x(x, name="x") -> DeviceArray:
    xa = _arrays.as_device_array(x, name)
    if xa.ndim < 1:
        raise ValueError(f"{name}: must have at least one axis (the normalized one), got a scalar")
    return xa


def _check_like(arr, name: str, xa: DeviceArray, shape, required=False) -> DeviceArray | None:
    if arr is None and not required:
        return None
    a = _arrays.as_device_array(arr, name)
    if a.shape != tuple(shape):
        raise ValueError(f"{name}: shape {a.shape} does not match {tuple(shape)} (from {xa.name} {xa.shape})")
    if a.dtype != xa.dtype:
        raise ValueError(f"{name}: dtype {a.dtype} differs from {xa.name}'s {xa.dtype}; "
                         "cast it so that all inputs share one dtype")
    return a


def _check_stats(arr, name: str, xa: DeviceArray, rows: int) -> DeviceArray:
    a = _arrays.as_device_array(arr, name, dtypes=("float32",))
    lead = xa.shape[:-1]
    if a.shape not in (tuple(lead), tuple(lead) + (1,)) and not (a.ndim == 1 and a.shape[0] == rows):
        raise ValueError(f"{name}: shape {a.shape} does not match {xa.name}'s leading shape {tuple(lead)}")
    return a.contiguous()


def _check_eps(eps) -> np.float32:
    try:
        e = float(eps)
    except (TypeError, ValueError):
        raise TypeError(f"eps: expected a number, got {type(eps).__name__}") from None
    if not math.isfinite(e) or e < 0:
        raise ValueError(f"eps: must be finite and non-negative, got {eps}")
    return np.float32(e)


# ---- forward --------------------------------------------------------------------------------

def _forward(rms: bool, x, weight, bias, eps, residual, return_stats):
    xa = _check_x(x)
    cols = xa.shape[-1]
    wa = _check_like(weight, "weight", xa, (cols,))
    ba = _check_like(bias, "bias", xa, (cols,))
    ra = _check_like(residual, "residual", xa, xa.shape)
    epsf = _check_eps(eps)
    device = _arrays.same_device(xa, wa, ba, ra)
    if wa is not None:
        wa = wa.contiguous()
    if ba is not None:
        ba = ba.contiguous()
    lead = xa.shape[:-1]
    rows = math.prod(lead)

    y = _arrays.empty(xa, xa.shape)
    h = _arrays.empty(xa, xa.shape) if ra is not None else None
    mean = _arrays.empty(xa, lead, "float32") if (return_stats and not rms) else None
    rstd = _arrays.empty(xa, lead, "float32") if return_stats else None

    with _arrays.launch_context(xa):
        if rows and cols:
            xa, xs = _rows_view(xa)
            ra, rs = _rows_view(ra) if ra is not None else (None, 0)
            vec = _vector_width(xa.itemsize, cols, [(xa, xs), (ra, rs), (wa, 0), (ba, 0), (y, cols)])
            inst, threads, rpb, _ = _instance("fwd", FWD_CONFIGS, xa.ctype, rms, vec, cols)
            fn = _kernels.function(SOURCE, inst, device)
            grid = min(-(-rows // rpb), _kernels.resident_blocks(fn, threads, device))
            _kernels.launch(fn, grid, threads, (
                xa, np.int64(xs), ra, np.int64(rs), wa, ba, y, h, mean, rstd,
                np.int64(rows), np.int32(cols), epsf))
        elif rows:  # zero-width rows: nothing to normalize; y and h are empty
            if mean is not None:
                _arrays.fill(mean, 0.0)
            if rstd is not None:
                _arrays.fill(rstd, float(1.0 / np.sqrt(epsf)) if epsf > 0 else float("inf"))

    out = [y.obj]
    if h is not None:
        out.append(h.obj)
    if return_stats:
        if mean is not None:
            out.append(mean.obj)
        out.append(rstd.obj)
    return out[0] if len(out) == 1 else tuple(out)


def layer_norm(x, weight=None, bias=None, eps=1e-5, *, residual=None, return_stats=False):
    """LayerNorm over the last axis: ``(x - mean) / sqrt(var + eps) * weight + bias``.

    Args:
        x: (*, D) float32, float16 or bfloat16 (CuPy array or torch CUDA tensor).
        weight, bias: (D,) of x's dtype, or None.
        eps: added to the (biased) variance.
        residual: optional (*, D) of x's dtype. The kernel then also returns
            ``h = x + residual`` (rounded to the dtype) and normalizes h, in one pass.
        return_stats: also return mean and rstd, float32 of shape x.shape[:-1].

    Returns:
        ``y``; with ``residual``: ``(y, h)``; with ``return_stats``: ``(y, mean, rstd)`` or
        ``(y, h, mean, rstd)``. Same array type and device as ``x``.
    """
    return _forward(False, x, weight, bias, eps, residual, return_stats)


def rms_norm(x, weight=None, eps=1e-6, *, residual=None, return_stats=False):
    """RMSNorm over the last axis: ``x / sqrt(mean(x**2) + eps) * weight``.

    Args:
        x: (*, D) float32, float16 or bfloat16 (CuPy array or torch CUDA tensor).
        weight: (D,) of x's dtype, or None.
        eps: added to the mean square.
        residual: optional (*, D) of x's dtype; see ``layer_norm``.
        return_stats: also return rstd, float32 of shape x.shape[:-1].

    Returns:
        ``y``; with ``residual``: ``(y, h)``; with ``return_stats``: ``(y, rstd)`` or
        ``(y, h, rstd)``.
    """
    return _forward(True, x, weight, None, eps, residual, return_stats)


# ---- backward -------------------------------------------------------------------------------

def _backward(rms: bool, dy, x, weight, mean, rstd, dresidual):
    da = _check_x(dy, "dy")
    xa = _check_like(x, "x", da, da.shape, required=True)
    cols = xa.shape[-1]
    lead = xa.shape[:-1]
    rows = math.prod(lead)
    wa = _check_like(weight, "weight", xa, (cols,))
    ma = None if rms else _check_stats(mean, "mean", xa, rows)
    sa = _check_stats(rstd, "rstd", xa, rows)
    dra = _check_like(dresidual, "dresidual", xa, xa.shape)
    device = _arrays.same_device(xa, da, wa, ma, sa, dra)
    if wa is not None:
        wa = wa.contiguous()

    dx = _arrays.empty(xa, xa.shape)
    want_db = not rms
    with _arrays.launch_context(xa):
        if not (rows and cols):
            dw = _arrays.zeros(xa, (cols,)) if wa is not None else None
            db = _arrays.zeros(xa, (cols,)) if want_db else None
        else:
            xa, xs = _rows_view(xa)
            da, ds = _rows_view(da)
            dra, drs = _rows_view(dra) if dra is not None else (None, 0)
            vec = _vector_width(xa.itemsize, cols, [(xa, xs), (da, ds), (dra, drs), (wa, 0), (dx, cols)])
            inst, threads, rpb, groups = _instance("bwd", BWD_CONFIGS, xa.ctype, rms, vec, cols)
            fn = _kernels.function(SOURCE, inst, device)
            grid = min(-(-rows // rpb), _kernels.resident_blocks(fn, threads, device))
            nparts = grid * groups
            dw_part = _arrays.empty(xa, (nparts, cols), "float32") if wa is not None else None
            db_part = _arrays.empty(xa, (nparts, cols), "float32") if want_db else None
            _kernels.launch(fn, grid, threads, (
                da, np.int64(ds), xa, np.int64(xs), wa, ma, sa, dra, np.int64(drs),
                dx, dw_part, db_part, np.int64(rows), np.int32(cols)))
            dw = _partials.sum_rows(dw_part, xa, nparts, cols, device)
            db = _partials.sum_rows(db_part, xa, nparts, cols, device)
    return dx.obj, (dw.obj if dw is not None else None), (db.obj if db is not None else None)


def layer_norm_backward(dy, x, weight, mean, rstd, *, dresidual=None):
    """Gradients of ``layer_norm``.

    Args:
        dy: (*, D) gradient of the output y.
        x: (*, D) the forward's input — ``h`` when the residual add was fused.
        weight: (D,) or None, as in the forward.
        mean, rstd: float32 statistics from ``layer_norm(..., return_stats=True)``.
        dresidual: optional (*, D) gradient flowing into ``h`` from the residual stream;
            it is added to dx (which is then the gradient of both x and residual).

    Returns:
        ``(dx, dweight, dbias)``: dx (*, D); dweight (D,) or None when weight is None;
        dbias (D,). Weight gradients are bitwise deterministic (no atomics).
    """
    return _backward(False, dy, x, weight, mean, rstd, dresidual)


def rms_norm_backward(dy, x, weight, rstd, *, dresidual=None):
    """Gradients of ``rms_norm``: ``(dx, dweight)``; see ``layer_norm_backward``."""
    dx, dw, _ = _backward(True, dy, x, weight, None, rstd, dresidual)
    return dx, dw
