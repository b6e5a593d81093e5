"""``layer_norm_backward`` and ``rms_norm_backward``: the backward's array functions and plans."""
from __future__ import annotations

import math

from .. import _arrays, _kernels, _partials
from .._arrays import DeviceArray
from .._plans import Builder, Plan, PlanCache
from . import configs as _cfg
from .checks import _check_backward, _optional
from .configs import Configs
from .forward import _casting, _offset

# ---- backward -------------------------------------------------------------------------------

_BWD = PlanCache()


def _backward(rms: bool, dy, x, weight, mean, rstd, dresidual, configs: Configs, offset=0.0, casting_mode="gemma"):
    arrays = [_arrays.as_device_array(dy, "dy"), _arrays.as_device_array(x, "x"), _optional(weight, "weight"),
              None if rms else _arrays.as_device_array(mean, "mean", ("float32",)),
              _arrays.as_device_array(rstd, "rstd", ("float32",)), _optional(dresidual, "dresidual")]
    off = _offset(offset, weight)
    cast = min(_casting(casting_mode, rms), 1)   # ("none" and "llama" share the backward)
    key = (rms, off, cast, configs, *(a and a.key for a in arrays))
    plan = _BWD.plan(key, _plan_backward, rms, arrays, configs, off, cast)
    bufs = plan(arrays)
    return plan.out(bufs, "dx"), plan.out(bufs, "dw"), plan.out(bufs, "db")


def _plan_backward(rms, arrays, configs, offset=0.0, cast=0) -> Plan:
    da, xa, wa, ma, sa, dra = arrays
    _check_backward(da, xa, wa, ma, sa, dra, rms)
    if xa.itemsize == 4:
        cast = 0
    device = _arrays.same_device(xa, da, wa, ma, sa, dra)
    cols = xa.shape[-1]
    rows = math.prod(xa.shape[:-1])
    b = Builder(arrays)
    for i, a in ((2, wa), (3, ma), (4, sa)):
        if a is not None and not _arrays.is_contiguous(a):
            b.fix(i, DeviceArray.contiguous)
    dx = b.alloc(xa.shape, xa.dtype, name="dx")
    dw = b.alloc((cols,), xa.dtype, name="dw") if wa is not None else b.absent("dw")
    db = b.alloc((cols,), xa.dtype, name="db") if not rms else b.absent("db")
    if not (rows and cols):
        b.fill(0.0, dw, db)
        return b.plan(device, first=1)
    strides, copies = {}, set()
    for i, a in ((0, da), (1, xa), (5, dra)):
        if a is not None:
            copy, strides[i] = _arrays.rows_view(a)
            if copy:
                copies.add(i)
                b.fix(i, DeviceArray.contiguous)
    vec = _arrays.vector_width(xa.itemsize, cols, [(None if i in copies else a, strides.get(i, 0))
                                            for i, a in ((0, da), (1, xa), (5, dra))] + [(wa, 0)])
    cfg = configs.loop if cast and vec == 1 else configs.pick("bwd", cols, vec)
    k = _kernels.kernel(cfg.instance("bwd", xa.dtype, rms, vec, offset != 0, cast), device)
    grid = min(-(-rows // cfg.rows_per_block), k.resident_blocks())
    nparts = grid * cfg.groups
    # One float32 scratch block for the partial rows of dweight and dbias (one allocation, one
    # summing launch for both).
    outs = [o for o in (dw, db) if o is not None]
    part = b.alloc((len(outs), nparts, cols), "float32") if outs else None
    block = nparts * cols * 4
    b.launch(k, grid, dy=b.slot(0), dy_stride=strides[0], x=b.slot(1), x_stride=strides[1], w=b.slot(2),
             mean=b.slot(3), rstd=b.slot(4), dres=b.slot(5), dres_stride=strides.get(5, 0), dx=dx,
             dw_part=part if dw is not None else None, db_part=None if db is None else part + block * (len(outs) - 1),
             rows=rows, cols=cols, w_offset=offset)
    if outs:
        _partials.sum_rows(b, part, outs, nparts, cols, xa.dtype, device)
    return b.plan(device, first=1)


def layer_norm_backward(dy, x, weight, mean, rstd, *, dresidual=None, offset=0.0):
    """Gradients of ``layer_norm``.

    Args:
        dy: (*, D) gradient of the output y.
        x: (*, D) the forward's input — ``h`` when the residual add was fused.
        weight: (D,) or None, and offset, as in the forward.
        mean, rstd: float32 statistics from ``layer_norm(..., return_stats=True)``.
        dresidual: optional (*, D) gradient flowing into ``h`` from the residual stream;
            it is added to dx (which is then the gradient of both x and residual).

    Returns:
        ``(dx, dweight, dbias)``: dx (*, D); dweight (D,) or None when weight is None;
        dbias (D,). Weight gradients are bitwise deterministic (no atomics).
    """
    return _backward(False, dy, x, weight, mean, rstd, dresidual, _cfg.CONFIGS, offset)


def rms_norm_backward(dy, x, weight, rstd, *, dresidual=None, offset=0.0, casting_mode="gemma"):
    """Gradients of ``rms_norm``: ``(dx, dweight)``; see ``layer_norm_backward``. casting_mode:
    the forward's. In "llama" and "none", ``dy * weight`` is rounded to x's dtype and dweight
    sums ``dy * xhat`` with xhat rounded, as autograd through Hugging Face's LlamaRMSNorm."""
    dx, dw, _ = _backward(True, dy, x, weight, None, rstd, dresidual, _cfg.CONFIGS, offset, casting_mode)
    return dx, dw
