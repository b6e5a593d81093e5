"""``layer_norm`` and ``rms_norm``: the forward's array functions and launch plans (residual,
offset, casting modes, fp8 output)."""
from __future__ import annotations

import math

import numpy as np

from .. import _arrays, _checks, _kernels
from .._arrays import DeviceArray
from .._kernels import Slot
from .._plans import Builder, Plan, PlanCache
from . import configs as _cfg
from .checks import _check_forward, _optional
from .configs import CASTING_MODES, Configs, LoopConfig

# ---- forward --------------------------------------------------------------------------------

_FWD = PlanCache()


def _offset(offset, weight) -> float:
    """The weight's offset: a finite number, and a weight to add it to unless it is 0."""
    value = _checks._number(offset, "offset")
    if not math.isfinite(value):
        raise ValueError(f"offset: must be finite, got {offset}")
    if value and weight is None:
        raise ValueError(f"offset: {offset} is added to the weight, but weight is None")
    return value


def _casting(mode, rms: bool) -> int:
    """The CAST template argument of a casting mode (RMSNorm's; LayerNorm's is "gemma")."""
    if mode not in CASTING_MODES:
        raise ValueError(f"casting_mode: expected one of {', '.join(map(repr, CASTING_MODES))}, got {mode!r}")
    return CASTING_MODES[mode]


def _out_dtype(out_dtype, xa) -> str | None:
    """None (x's dtype) or the fp8 dtype's name ("float8_e4m3fn", "float8_e5m2"), from a name, a
    torch dtype or an ml_dtypes/NumPy dtype."""
    if out_dtype is None:
        return None
    name = getattr(out_dtype, "name", None) if not isinstance(out_dtype, str) else out_dtype
    if name is None:   # a torch dtype ("torch.float8_e4m3fn") or an ml_dtypes scalar type
        name = str(out_dtype).removeprefix("torch.")
        if name.startswith("<class"):
            name = np.dtype(out_dtype).name
    if name == xa.dtype:
        return None
    if name not in _arrays.FP8:
        raise ValueError(f"out_dtype: expected None, {xa.name}'s dtype or one of {', '.join(_arrays.FP8)}; "
                         f"got {out_dtype!r}")
    return name


def _scalar(obj, name: str, host: bool = False) -> DeviceArray:
    """A float32 array of one element (the fp8 scale, the amax)."""
    a = (_arrays.as_host_array if host else _arrays.as_device_array)(obj, name, ("float32",))
    if a.size != 1:
        raise ValueError(f"{name}: expected one float32 element, got shape {a.shape}")
    return a


def _forward(rms: bool, x, weight, bias, eps, residual, return_stats, configs: Configs, offset=0.0,
             casting_mode="gemma", out_dtype=None, scale=None, amax=None):
    xa = _arrays.as_device_array(x, "x")
    out = _out_dtype(out_dtype, xa)
    arrays = [xa, _optional(weight, "weight"), _optional(bias, "bias"), _optional(residual, "residual"),
              None if scale is None else _scalar(scale, "scale"), None if amax is None else _scalar(amax, "amax")]
    off = _offset(offset, weight)
    cast = _casting(casting_mode, rms)
    key = (rms, bool(return_stats), _checks.eps(eps), off, cast, out, configs, *(a and a.key for a in arrays))
    plan = _FWD.plan(key, _plan_forward, rms, arrays, eps, bool(return_stats), configs, off, cast, out)
    bufs = plan(arrays)
    # (y; h with a residual; mean (LayerNorm) and rstd with the statistics)
    out = [plan.out(bufs, name) for name in ("y", "h", "mean", "rstd") if name in plan.outputs]
    return out[0] if len(out) == 1 else tuple(out)


def _plan_forward(rms, arrays, eps, return_stats, configs, offset=0.0, cast=0, out=None) -> Plan:
    xa, wa, ba, ra, sa, aa = arrays
    epsf = _check_forward(xa, wa, ba, ra, eps)
    _check_fp8(out, sa, aa, cast)
    device = _arrays.same_device(xa, wa, ba, ra, sa, aa)
    cols = xa.shape[-1]
    lead = xa.shape[:-1]
    rows = math.prod(lead)
    if xa.itemsize == 4:   # (float32 has nothing to round: every mode is "gemma")
        cast = 0
    b = Builder(arrays)
    if aa is not None:   # (max |y| is merged into it by the kernels' atomics)
        b.fill(0.0, Slot(5))
    y = b.alloc(xa.shape, out or xa.dtype, name="y")
    h = b.alloc(xa.shape, xa.dtype, name="h") if ra is not None else None
    mean = b.alloc(lead, "float32", name="mean") if return_stats and not rms else None
    rstd = b.alloc(lead, "float32", name="rstd") if return_stats else None
    if rows and cols:
        copy_x, xs = _arrays.rows_view(xa)
        copy_r, rs = _arrays.rows_view(ra) if ra is not None else (False, 0)
        for i, copy in ((0, copy_x), (3, copy_r), (1, wa is not None and wa.strides != (1,)),
                        (2, ba is not None and ba.strides != (1,))):
            if copy:
                b.fix(i, DeviceArray.contiguous)
        # (a fresh copy is 256-byte aligned and contiguous)
        vec = _arrays.vector_width(xa.itemsize, cols, [(None if copy_x else xa, xs), (None if copy_r else ra, rs),
                                                 (wa, 0), (ba, 0)])
        variant = bool(cast or out)
        exact = configs.rms_exact_pick(cols, vec) if rms and ra is None and not variant and vec == 8 else None
        if exact is not None:
            cfg = exact
        else:
            kind = "res" if ra is not None else "fp8" if out and xa.itemsize == 2 else "fwd"
            cfg = configs.loop if variant and vec == 1 else configs.pick(kind, cols, vec)
        k = _kernels.kernel(cfg.instance("fwd", xa.dtype, rms, vec, offset != 0, cast, out), device)
        # A row in registers: one block a row group, not a persistent grid (a finished block's
        # slot starts the next rows' loads at once; 2-8% faster at every width measured). The
        # looped kernel keeps a persistent grid.
        grid = -(-rows // cfg.rows_per_block)
        grid = min(grid, k.resident_blocks()) if isinstance(cfg, LoopConfig) else min(grid, 2**31 - 1)
        b.launch(k, grid,
                 x=b.slot(0), x_stride=xs, res=b.slot(3), res_stride=rs, w=b.slot(1), b=b.slot(2), y=y, h=h,
                 mean_out=mean, rstd_out=rstd, rows=rows, cols=cols, eps=epsf, w_offset=offset,
                 y_scale=b.slot(4), y_amax=b.slot(5))
    elif rows and return_stats:   # zero-width rows: nothing to normalize; y and h are empty
        b.fill(0.0, mean)
        r0 = np.float32(1.0) / np.sqrt(np.float32(epsf)) if epsf > 0 else np.float32(np.inf)
        b.fill(float(_round(r0, xa.dtype) if cast == 2 else r0), rstd)
    return b.plan(device)


def _check_fp8(out, sa, aa, cast) -> None:
    if out is None:
        for a in (sa, aa):
            if a is not None:
                raise ValueError(f"{a.name}: applies to an fp8 output alone (out_dtype float8_e4m3fn or float8_e5m2)")
        return
    if sa is None:
        raise ValueError(f"scale: required with out_dtype {out} (a float32 device scalar: y_fp8 = y * scale)")
    if cast:
        raise ValueError("casting_mode: an fp8 output takes the float32 result (casting_mode 'gemma')")


def _round(v, dtype: str) -> float:
    """``v`` rounded to ``dtype`` (round to nearest even) and back, as a float."""
    return float(np.asarray(v, np.float64).astype(_arrays._np_dtype(dtype)).astype(np.float64))


def layer_norm(x, weight=None, bias=None, eps=1e-5, *, residual=None, return_stats=False, offset=0.0,
               out_dtype=None, scale=None, amax=None):
    """LayerNorm over the last axis: ``(x - mean) / sqrt(var + eps) * (weight + offset) + bias``.

    Args:
        x: (*, D) float32, float16 or bfloat16 (CuPy array or torch CUDA tensor).
        weight, bias: (D,) of x's dtype, or None.
        eps: added to the (biased) variance.
        offset: added to the weight in float32 (1.0: zero-centred gamma, as TransformerEngine's
            ``zero_centered_gamma``); needs a weight unless 0.
        residual: optional (*, D) of x's dtype. The kernel then also returns
            ``h = x + residual`` (rounded to the dtype) and normalizes h, in one pass.
        return_stats: also return mean and rstd, float32 of shape x.shape[:-1].
        out_dtype: None (x's dtype), or ``"float8_e4m3fn"`` / ``"float8_e5m2"`` (or the torch
            or ml_dtypes dtype): y is then ``saturate(y * scale)`` rounded to nearest even, as
            TransformerEngine's fp8 norms. torch callers get a torch float8 tensor; CuPy has no
            fp8 dtype, so CuPy callers get a uint8 array holding the fp8 bytes (view it with
            ``ml_dtypes``).
        scale: with an fp8 out_dtype, a float32 device array of one element (required).
        amax: with an fp8 out_dtype, a float32 device array of one element that receives
            ``max |y|`` of the unscaled output (NaN if y has a NaN), reduced on the device:
            exact, so deterministic; or None.

    Returns:
        ``y``; with ``residual``: ``(y, h)``; with ``return_stats``: ``(y, mean, rstd)`` or
        ``(y, h, mean, rstd)``. Same array type and device as ``x``; contiguous.
    """
    return _forward(False, x, weight, bias, eps, residual, return_stats, _cfg.CONFIGS, offset, "gemma", out_dtype,
                    scale, amax)


def rms_norm(x, weight=None, eps=1e-6, *, residual=None, return_stats=False, offset=0.0, casting_mode="gemma",
             out_dtype=None, scale=None, amax=None):
    """RMSNorm over the last axis: ``x / sqrt(mean(x**2) + eps) * (weight + offset)``.

    Args:
        x: (*, D) float32, float16 or bfloat16 (CuPy array or torch CUDA tensor).
        weight: (D,) of x's dtype, or None.
        eps: added to the mean square.
        offset: added to the weight in float32 (1.0: Gemma's ``(1 + weight)``); needs a weight
            unless 0.
        residual: optional (*, D) of x's dtype; see ``layer_norm``.
        return_stats: also return rstd, float32 of shape x.shape[:-1].
        casting_mode: where float16/bfloat16 inputs are rounded, as Liger's RMSNorm:
            ``"gemma"`` (default): float32 throughout, y rounded once, as
            ``torch.nn.functional.rms_norm`` and Gemma's RMSNorm; ``"llama"``: ``x * rstd``
            rounded to x's dtype before the weight, as Hugging Face's LlamaRMSNorm
            (``weight * hidden.to(dtype)``); ``"none"``: as "llama" with rstd rounded too (the
            norm in the input dtype; the rstd returned is the rounded one). Pass the same
            mode to ``rms_norm_backward``. float32 inputs are the same in every mode.
        out_dtype, scale, amax: an fp8 output; see ``layer_norm`` ("gemma" mode only).

    Returns:
        ``y``; with ``residual``: ``(y, h)``; with ``return_stats``: ``(y, rstd)`` or
        ``(y, h, rstd)``.
    """
    return _forward(True, x, weight, None, eps, residual, return_stats, _cfg.CONFIGS, offset, casting_mode, out_dtype,
                    scale, amax)
