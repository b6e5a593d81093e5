"""LayerNorm and RMSNorm over the last axis, forward and backward (kernels: cuda_src/norm.cu).

Shapes: ``x`` is (*, D); the norm is taken over D. ``weight`` and ``bias`` are (D,).
dtypes: float32, float16, bfloat16 — every array argument of one call has the same dtype;
statistics (mean, rstd) are float32 of shape x.shape[:-1]. Arithmetic is float32.

This module is the whole Python side of the family: kernel configurations, the array
functions with their launch plans, the NumPy references, the benchmark cases and the PyTorch
bindings (declared at the end, in ``FAMILY``).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from . import _arrays, _bench, _checks, _kernels, _partials
from ._arrays import DeviceArray
from ._family import DropIn, Family, ModuleSpec, TorchOp
from ._kernels import Instance
from ._plans import Builder, Plan, PlanCache

__all__ = ["layer_norm", "rms_norm", "layer_norm_backward", "rms_norm_backward"]

SOURCE = "norm.cu"


# ---- kernel configurations --------------------------------------------------------------------

@dataclass(frozen=True)
class RowConfig:
    """norm_fwd / norm_bwd, a row in registers: a thread holds ``nv`` vectors of a row, ``g``
    threads own a row, a block has ``threads`` threads, a group takes ``r`` rows at a time, and
    ptxas is asked to fit ``minb`` blocks an SM (which sets the register budget)."""
    nv: int
    g: int
    threads: int
    r: int = 1
    minb: int = 1

    @property
    def capacity(self) -> int:
        """Vectors a row can have."""
        return self.nv * self.g

    @property
    def groups(self) -> int:
        """Row groups a block (each writes one partial weight-gradient row in the backward)."""
        return self.threads // self.g

    @property
    def rows_per_block(self) -> int:
        return self.groups * self.r

    def instance(self, kind: str, dtype: str, rms: bool, vec: int, offset: bool = False) -> Instance:
        ctype = _arrays.DTYPES[dtype][0]
        return Instance(SOURCE, f"norm_{kind}<{ctype}, {str(rms).lower()}, {vec}, {self.nv}, {self.g}, "
                                f"{self.threads}, {self.r}, {self.minb}, {str(offset).lower()}>", self.threads)


@dataclass(frozen=True)
class LoopConfig:
    """norm_fwd_loop / norm_bwd_loop: rows of any width, one block a row, in chunks."""
    threads: int = 512
    rows_per_block = 1
    groups = 1

    def instance(self, kind: str, dtype: str, rms: bool, vec: int, offset: bool = False) -> Instance:
        ctype = _arrays.DTYPES[dtype][0]
        return Instance(SOURCE, f"norm_{kind}_loop<{ctype}, {str(rms).lower()}, {vec}, {self.threads}, "
                                f"{str(offset).lower()}>", self.threads)


@dataclass(frozen=True, eq=False)   # (hashed by identity: plans are keyed by it, on every call)
class Configs:
    """The row-in-registers configurations of each direction, in order of capacity (the first
    that holds the row is used; wider rows take the looped kernel). Chosen by measurement
    (docs/notes-norm.md); none spills (the compile check)."""
    fwd: tuple[RowConfig, ...]
    bwd: tuple[RowConfig, ...]
    loop: LoopConfig = LoopConfig()

    def pick(self, kind: str, cols: int, vec: int) -> RowConfig | LoopConfig:
        nvec = -(-cols // vec)
        for c in (self.fwd if kind == "fwd" else self.bwd):
            if c.capacity >= nvec:
                return c
        return self.loop


CONFIGS = Configs(
    fwd=(RowConfig(1, 4, 128), RowConfig(1, 16, 128), RowConfig(1, 32, 128, 2), RowConfig(2, 32, 128, 2),
         RowConfig(4, 32, 128), RowConfig(2, 128, 128), RowConfig(4, 128, 128, 1, 7), RowConfig(4, 256, 256),
         RowConfig(4, 512, 512)),
    bwd=(RowConfig(1, 4, 128), RowConfig(1, 16, 128), RowConfig(1, 32, 128), RowConfig(2, 32, 128, 1, 6),
         RowConfig(4, 32, 128, 1, 4), RowConfig(2, 128, 128, 1, 6), RowConfig(4, 128, 128, 1, 4),
         RowConfig(4, 256, 256, 1, 2)),
)


def instances(configs: Configs = CONFIGS) -> list[Instance]:
    """Every kernel instance the fronts can launch (for the compile check)."""
    out = []
    for dtype, (_, itemsize) in _arrays.DTYPES.items():
        for rms in (False, True):
            for vec in sorted({1, 16 // itemsize}):
                for kind, table in (("fwd", configs.fwd), ("bwd", configs.bwd)):
                    out += [c.instance(kind, dtype, rms, vec, offset) for c in (*table, configs.loop)
                            for offset in (False, True)]
    return out


def _vector_width(itemsize: int, cols: int, arrays) -> int:
    """16-byte vectors when every row of every array starts 16-byte aligned, else scalars."""
    vec = 16 // itemsize
    if cols % vec:
        return 1
    for a, stride in arrays:
        if a is not None and (a.ptr % 16 or stride % vec):
            return 1
    return vec


def _rows_view(a: DeviceArray) -> tuple[bool, int]:
    """(copy needed, row stride): the last axis must be unit-stride and the leading axes one
    uniformly strided axis; otherwise the kernels read a contiguous copy."""
    stride = a.row_stride()
    return (True, a.shape[-1]) if stride is None else (False, stride)


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


def _forward(rms: bool, x, weight, bias, eps, residual, return_stats, configs: Configs, offset=0.0):
    xa = _arrays.as_device_array(x, "x")
    arrays = [xa, _optional(weight, "weight"), _optional(bias, "bias"), _optional(residual, "residual")]
    off = _offset(offset, weight)
    key = (rms, bool(return_stats), _checks.eps(eps), off, configs, *(a and a.key for a in arrays))
    plan = _FWD.get(key) or _FWD.put(key, _plan_forward(rms, arrays, eps, bool(return_stats), configs, off))
    bufs = plan(arrays)
    # bufs: x, weight, bias, residual, then y, h (residual), mean (LayerNorm, stats), rstd (stats)
    out = [b.obj for b in bufs[4:]]
    return out[0] if len(out) == 1 else tuple(out)


def _plan_forward(rms, arrays, eps, return_stats, configs, offset=0.0) -> Plan:
    xa, wa, ba, ra = arrays
    epsf = _check_forward(xa, wa, ba, ra, eps)
    device = _arrays.same_device(xa, wa, ba, ra)
    cols = xa.shape[-1]
    lead = xa.shape[:-1]
    rows = math.prod(lead)
    b = Builder(arrays)
    y = b.alloc(xa.shape, xa.dtype)
    h = b.alloc(xa.shape, xa.dtype) if ra is not None else None
    mean = b.alloc(lead, "float32") if return_stats and not rms else None
    rstd = b.alloc(lead, "float32") if return_stats else None
    if rows and cols:
        copy_x, xs = _rows_view(xa)
        copy_r, rs = _rows_view(ra) if ra is not None else (False, 0)
        for i, copy in ((0, copy_x), (3, copy_r), (1, wa is not None and wa.strides != (1,)),
                        (2, ba is not None and ba.strides != (1,))):
            if copy:
                b.fix(i, DeviceArray.contiguous)
        # (a fresh copy is 256-byte aligned and contiguous)
        vec = _vector_width(xa.itemsize, cols, [(None if copy_x else xa, xs), (None if copy_r else ra, rs),
                                                 (wa, 0), (ba, 0)])
        cfg = configs.pick("fwd", cols, vec)
        k = _kernels.kernel(cfg.instance("fwd", xa.dtype, rms, vec, offset != 0), device)
        # A row in registers: one block a row group, not a persistent grid (a finished block's
        # slot starts the next rows' loads at once; 2-8% faster at every width measured). The
        # looped kernel keeps a persistent grid.
        grid = -(-rows // cfg.rows_per_block)
        grid = min(grid, k.resident_blocks()) if isinstance(cfg, LoopConfig) else min(grid, 2**31 - 1)
        b.launch(k, grid,
                 x=b.slot(0), x_stride=xs, res=b.slot(3), res_stride=rs, w=b.slot(1), b=b.slot(2), y=y, h=h,
                 mean_out=mean, rstd_out=rstd, rows=rows, cols=cols, eps=epsf, w_offset=offset)
    elif rows and return_stats:   # zero-width rows: nothing to normalize; y and h are empty
        b.fill(0.0, mean)
        b.fill(float(1.0 / np.sqrt(np.float32(epsf))) if epsf > 0 else float("inf"), rstd)
    return b.plan(device)


def layer_norm(x, weight=None, bias=None, eps=1e-5, *, residual=None, return_stats=False, offset=0.0):
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

    Returns:
        ``y``; with ``residual``: ``(y, h)``; with ``return_stats``: ``(y, mean, rstd)`` or
        ``(y, h, mean, rstd)``. Same array type and device as ``x``; contiguous.
    """
    return _forward(False, x, weight, bias, eps, residual, return_stats, CONFIGS, offset)


def rms_norm(x, weight=None, eps=1e-6, *, residual=None, return_stats=False, offset=0.0):
    """RMSNorm over the last axis: ``x / sqrt(mean(x**2) + eps) * (weight + offset)``.

    Args:
        x: (*, D) float32, float16 or bfloat16 (CuPy array or torch CUDA tensor).
        weight: (D,) of x's dtype, or None.
        eps: added to the mean square.
        offset: added to the weight in float32 (1.0: Gemma's ``(1 + weight)``); needs a weight
            unless 0.
        residual: optional (*, D) of x's dtype; see ``layer_norm``.
        return_stats: also return rstd, float32 of shape x.shape[:-1].

    Returns:
        ``y``; with ``residual``: ``(y, h)``; with ``return_stats``: ``(y, rstd)`` or
        ``(y, h, rstd)``.
    """
    return _forward(True, x, weight, None, eps, residual, return_stats, CONFIGS, offset)


# ---- backward -------------------------------------------------------------------------------

_BWD = PlanCache()


def _backward(rms: bool, dy, x, weight, mean, rstd, dresidual, configs: Configs, offset=0.0):
    arrays = [_arrays.as_device_array(dy, "dy"), _arrays.as_device_array(x, "x"), _optional(weight, "weight"),
              None if rms else _arrays.as_device_array(mean, "mean", ("float32",)),
              _arrays.as_device_array(rstd, "rstd", ("float32",)), _optional(dresidual, "dresidual")]
    off = _offset(offset, weight)
    key = (rms, off, configs, *(a and a.key for a in arrays))
    plan = _BWD.get(key) or _BWD.put(key, _plan_backward(rms, arrays, configs, off))
    bufs = plan(arrays)
    # bufs: dy, x, weight, mean, rstd, dresidual, then dx, dw, db (or None), scratch
    return bufs[6].obj, bufs[7] and bufs[7].obj, bufs[8] and bufs[8].obj


def _plan_backward(rms, arrays, configs, offset=0.0) -> Plan:
    da, xa, wa, ma, sa, dra = arrays
    _check_backward(da, xa, wa, ma, sa, dra, rms)
    device = _arrays.same_device(xa, da, wa, ma, sa, dra)
    cols = xa.shape[-1]
    rows = math.prod(xa.shape[:-1])
    b = Builder(arrays)
    for i, a in ((2, wa), (3, ma), (4, sa)):
        if a is not None and not _arrays.is_contiguous(a):
            b.fix(i, DeviceArray.contiguous)
    dx = b.alloc(xa.shape, xa.dtype)
    dw = b.alloc((cols,), xa.dtype) if wa is not None else b.absent()
    db = b.alloc((cols,), xa.dtype) if not rms else b.absent()
    if not (rows and cols):
        b.fill(0.0, dw, db)
        return b.plan(device, first=1)
    strides, copies = {}, set()
    for i, a in ((0, da), (1, xa), (5, dra)):
        if a is not None:
            copy, strides[i] = _rows_view(a)
            if copy:
                copies.add(i)
                b.fix(i, DeviceArray.contiguous)
    vec = _vector_width(xa.itemsize, cols, [(None if i in copies else a, strides.get(i, 0))
                                            for i, a in ((0, da), (1, xa), (5, dra))] + [(wa, 0)])
    cfg = configs.pick("bwd", cols, vec)
    k = _kernels.kernel(cfg.instance("bwd", xa.dtype, rms, vec, offset != 0), device)
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
    return _backward(False, dy, x, weight, mean, rstd, dresidual, CONFIGS, offset)


def rms_norm_backward(dy, x, weight, rstd, *, dresidual=None, offset=0.0):
    """Gradients of ``rms_norm``: ``(dx, dweight)``; see ``layer_norm_backward``."""
    dx, dw, _ = _backward(True, dy, x, weight, None, rstd, dresidual, CONFIGS, offset)
    return dx, dw


# ---- NumPy references (float64; the oracle of the tests) -------------------------------------

def _host(obj, name, dtypes=_arrays.FLOATS):
    return None if obj is None else _arrays.as_host_array(obj, name, dtypes)


def _f64(a: DeviceArray | None):
    return None if a is None else a.obj.astype(np.float64)


def _ref_input(xa, ra):
    """(normalized input, h): h = x + residual rounded to x's dtype, or (x, None)."""
    if ra is None:
        return _f64(xa), None
    h = (_f64(xa) + _f64(ra)).astype(xa.obj.dtype).astype(np.float64)
    return h, h


def reference_layer_norm(x, weight=None, bias=None, eps=1e-5, *, residual=None, return_stats=False, offset=0.0):
    """``layer_norm`` in float64 from the given (rounded) values: the same arguments, checks
    and outputs (float64 arrays)."""
    xa, wa, ba, ra = _host(x, "x"), _host(weight, "weight"), _host(bias, "bias"), _host(residual, "residual")
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
    out = [y] + ([h] if h is not None else []) + ([mean, rstd] if return_stats else [])
    return out[0] if len(out) == 1 else tuple(out)


def reference_rms_norm(x, weight=None, eps=1e-6, *, residual=None, return_stats=False, offset=0.0):
    """``rms_norm`` in float64 (see ``reference_layer_norm``)."""
    xa, wa, ra = _host(x, "x"), _host(weight, "weight"), _host(residual, "residual")
    e = _check_forward(xa, wa, None, ra, eps)
    off = _offset(offset, weight)
    v, h = _ref_input(xa, ra)
    rstd = 1.0 / np.sqrt((v * v).mean(axis=-1) + e)
    y = v * rstd[..., None]
    if wa is not None:
        y = y * (_f64(wa) + off)
    out = [y] + ([h] if h is not None else []) + ([rstd] if return_stats else [])
    return out[0] if len(out) == 1 else tuple(out)


def _ref_backward(rms, dy, x, weight, mean, rstd, dresidual, offset=0.0):
    da, xa, wa = _host(dy, "dy"), _host(x, "x"), _host(weight, "weight")
    ma = None if rms else _host(mean, "mean", ("float32",))
    sa, dra = _host(rstd, "rstd", ("float32",)), _host(dresidual, "dresidual")
    _check_backward(da, xa, wa, ma, sa, dra, rms)
    off = _offset(offset, weight)
    g, v = _f64(da), _f64(xa)
    d = v.shape[-1]
    rs = _f64(sa).reshape(v.shape[:-1])[..., None]
    mu = 0.0 if rms else _f64(ma).reshape(v.shape[:-1])[..., None]
    xhat = (v - mu) * rs
    gw = g * (_f64(wa) + off) if wa is not None else g
    c = (gw * xhat).sum(axis=-1, keepdims=True) / max(d, 1)
    a = 0.0 if rms else gw.sum(axis=-1, keepdims=True) / max(d, 1)
    dx = rs * (gw - a - xhat * c)
    if dra is not None:
        dx = dx + _f64(dra)
    lead = tuple(range(v.ndim - 1))
    dw = (g * xhat).sum(axis=lead) if wa is not None else None
    return dx, dw, g.sum(axis=lead)


def reference_layer_norm_backward(dy, x, weight, mean, rstd, *, dresidual=None, offset=0.0):
    """``layer_norm_backward`` in float64: ``(dx, dweight or None, dbias)``."""
    return _ref_backward(False, dy, x, weight, mean, rstd, dresidual, offset)


def reference_rms_norm_backward(dy, x, weight, rstd, *, dresidual=None, offset=0.0):
    """``rms_norm_backward`` in float64: ``(dx, dweight or None)``."""
    dx, dw, _ = _ref_backward(True, dy, x, weight, None, rstd, dresidual, offset)
    return dx, dw


# ---- benchmark cases ----------------------------------------------------------------------------

# The workload: rows of the model dim 4096 for a batch of 32 x 2048 tokens.
WORKLOAD = {"full": (65536, 4096), "quick": (8192, 4096), "dtype": "bfloat16"}


def _inputs(shape, dtype, seed, *, bias, grad=False, residual=False) -> dict:
    gen = _bench.generator(seed)
    d = shape[-1]
    t = {"x": _bench.randn(shape, dtype, gen), "w": _bench.randn((d,), dtype, gen),
         "b": _bench.randn((d,), dtype, gen) if bias else None}
    if residual:
        t["r"] = _bench.randn(shape, dtype, gen)
    if grad:
        t["dy"] = _bench.randn(shape, dtype, gen)
        t["leaves"] = tuple(a.detach().requires_grad_(True) for a in (t["x"], t["w"]) + ((t["b"],) if bias else ()))
    return t


def _fwd(rms, t):
    return rms_norm(t["x"], t["w"]) if rms else layer_norm(t["x"], t["w"], t["b"])


def _torch_fwd(rms, t):
    import torch.nn.functional as F

    x = t["x"]
    return F.rms_norm(x, x.shape[-1:], t["w"], eps=1e-6) if rms else F.layer_norm(x, x.shape[-1:], t["w"], t["b"])


def _fwd_bwd(rms, t):
    if rms:
        y, rstd = rms_norm(t["x"], t["w"], return_stats=True)
        return (y, *rms_norm_backward(t["dy"], t["x"], t["w"], rstd))
    y, mean, rstd = layer_norm(t["x"], t["w"], t["b"], return_stats=True)
    return (y, *layer_norm_backward(t["dy"], t["x"], t["w"], mean, rstd))


def _torch_fwd_bwd(rms, t):
    import torch

    y = _forward_on(None, t, rms)
    return (y.detach(), *torch.autograd.grad(y, t["leaves"], t["dy"]))


def _forward_on(F, t, rms):
    """The forward through ``F`` (torch.nn.functional, cukern.torch or None for PyTorch's) on
    the autograd leaves: what the PyTorch-path cases time."""
    if F is None:
        import torch.nn.functional as F
    x, w = t["leaves"][:2]
    if rms:
        return F.rms_norm(x, x.shape[-1:], w, eps=1e-6)
    return F.layer_norm(x, x.shape[-1:], w, t["leaves"][2])


def _res(rms, t):
    return rms_norm(t["x"], t["w"], residual=t["r"]) if rms else layer_norm(t["x"], t["w"], t["b"], residual=t["r"])


def _torch_res(rms, t):
    import torch.nn.functional as F

    h = t["x"] + t["r"]
    y = F.rms_norm(h, h.shape[-1:], t["w"], eps=1e-6) if rms else F.layer_norm(h, h.shape[-1:], t["w"], t["b"])
    return y, h


def bench_cases(quick: bool) -> list:
    """(N, D); bytes in passes of N*D elements: fwd 2 (x, y), fwd+bwd 5 (+ dy, x, dx), fused
    residual 4 (x, r in; y, h out). Weights and statistics are O(N + D), left out."""
    nd, dt = WORKLOAD["quick" if quick else "full"], WORKLOAD["dtype"]
    p = functools.partial
    cases = []
    for rms, name in ((False, "layer_norm"), (True, "rms_norm")):
        make = p(_inputs, nd, dt, bias=not rms)
        cases += [
            _bench.Case(f"{name} fwd", "norm", nd, dt, _bench.elements_bytes(nd, dt, 2), make, p(_fwd, rms),
                        p(_torch_fwd, rms)),
            _bench.Case(f"{name} fwd+bwd", "norm", nd, dt, _bench.elements_bytes(nd, dt, 5), p(make, grad=True),
                        p(_fwd_bwd, rms), p(_torch_fwd_bwd, rms)),
        ]
    for rms, name in ((False, "layer_norm"), (True, "rms_norm")):
        cases.append(_bench.Case(f"{name} +residual fwd", "norm", nd, dt, _bench.elements_bytes(nd, dt, 4),
                                 p(_inputs, nd, dt, bias=not rms, residual=True), p(_res, rms), p(_torch_res, rms)))
    # (the order of the table as before: fwd, fwd, fwd+bwd, fwd+bwd, residual, residual)
    return [cases[0], cases[2], cases[1], cases[3], cases[4], cases[5]]


def _liger(rms, t):
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    x, w = t["leaves"][:2]
    if rms:
        return LigerRMSNormFunction.apply(x, w, 1e-6, 0.0, "llama", False)
    return LigerLayerNormFunction.apply(x, w, t["leaves"][2], 1e-5)


def torch_bench_cases(quick: bool) -> list:
    """The norms through cukern.torch with autograd, against PyTorch eager, torch.compile and
    Liger: forward + backward, and the forward alone without autograd."""
    nd, dt = WORKLOAD["quick" if quick else "full"], WORKLOAD["dtype"]
    p = functools.partial
    cases = []
    for rms, name in ((False, "layer_norm"), (True, "rms_norm")):
        make = p(_inputs, nd, dt, bias=not rms, grad=True)
        cases.append(_bench.TorchCase(f"{name} fwd+bwd", "norm", nd, dt, _bench.elements_bytes(nd, dt, 5), make,
                                      p(_forward_on, rms=rms), p(_fwd_bwd, rms), liger=p(_liger, rms)))
    cases.append(_bench.TorchCase("rms_norm fwd", "norm", nd, dt, _bench.elements_bytes(nd, dt, 2),
                                  p(_inputs, nd, dt, bias=False, grad=True), p(_forward_on, rms=True),
                                  p(_fwd, True), liger=p(_liger, True), backward=False))
    return cases


# ---- PyTorch bindings -------------------------------------------------------------------------

def _ln_fake(x, weight, bias, eps):
    import torch

    stats = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return torch.empty_like(x, memory_format=torch.contiguous_format), stats, torch.empty_like(stats)


def _ln_bwd_fake(dy, x, weight, mean, rstd):
    import torch

    d = x.shape[-1]
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            x.new_empty((d,) if weight is not None else (0,)), x.new_empty((d,)))


def _rms_fake(x, weight, eps):
    import torch

    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(x.shape[:-1], dtype=torch.float32)


def _rms_bwd_fake(dy, x, weight, rstd):
    import torch

    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            x.new_empty((x.shape[-1],) if weight is not None else (0,)))


TORCH_OPS = (
    TorchOp("layer_norm", "(Tensor x, Tensor? weight, Tensor? bias, float eps) -> (Tensor, Tensor, Tensor)",
            forward=lambda x, w, b, eps: layer_norm(x, w, b, eps, return_stats=True),
            inference=lambda x, w, b, eps: layer_norm(x, w, b, eps),
            fake=_ln_fake,
            save=lambda inputs, outputs: ((inputs[0], inputs[1], outputs[1], outputs[2]), None),
            backward_schema="(Tensor dy, Tensor x, Tensor? weight, Tensor mean, Tensor rstd) "
                            "-> (Tensor, Tensor, Tensor)",
            backward=layer_norm_backward, backward_fake=_ln_bwd_fake,
            backward_args=lambda saved, state, grads, T: (grads[0], *saved), grads_to=(0, 1, 2), native=True),
    TorchOp("rms_norm", "(Tensor x, Tensor? weight, float eps) -> (Tensor, Tensor)",
            forward=lambda x, w, eps: rms_norm(x, w, eps, return_stats=True),
            inference=lambda x, w, eps: rms_norm(x, w, eps),
            fake=_rms_fake,
            save=lambda inputs, outputs: ((inputs[0], inputs[1], outputs[1]), None),
            backward_schema="(Tensor dy, Tensor x, Tensor? weight, Tensor rstd) -> (Tensor, Tensor)",
            backward=rms_norm_backward, backward_fake=_rms_bwd_fake,
            backward_args=lambda saved, state, grads, T: (grads[0], *saved), grads_to=(0, 1), native=True),
)


def _trailing(x, normalized_shape) -> int | None:
    """D = prod(normalized_shape) when it names x's trailing dims, else None."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if not shape or x.dim() < len(shape) or tuple(x.shape[x.dim() - len(shape):]) != shape:
        return None
    return math.prod(shape)


def _norm_args(T, op, x, normalized_shape, params):
    """(reason or None, x with the normalized dims as one last axis, the params as (D,), the
    post-processing view back) for a norm route."""
    d = _trailing(x, normalized_shape)
    reason = T.float_params(x, *params) or (None if d else "normalized_shape does not match the input")
    if reason is None and T.small(op, x.numel()):
        reason = T.SMALL
    if reason:
        return reason, None, (None,) * len(params), None
    if x.shape[-1] == d:   # one normalized dim: read as it is
        return None, x, [p if p is None or p.dim() == 1 else p.reshape(d) for p in params], None
    shape = x.shape
    lead = x.dim() - (1 if isinstance(normalized_shape, int) else len(normalized_shape))
    return None, x.reshape(*shape[:lead], d), [None if p is None else p.reshape(d) for p in params], \
        (lambda y: y.view(shape))


def _route_layer_norm(T, input, normalized_shape, weight=None, bias=None, eps=1e-5):
    """CUDA tensors of float32/float16/bfloat16 (after autocast), weight and bias of the same
    dtype and device, normalized_shape the trailing dims, at least min_size elements."""
    if not input.is_cuda:
        return "not a CUDA tensor"
    dt = T.autocast_dtype("layer_norm", input.dtype)
    reason, x, (w, b), post = _norm_args(T, "layer_norm", T.cast(input, dt), normalized_shape,
                                         (T.cast(weight, dt), T.cast(bias, dt)))
    return reason or ("layer_norm", (x, w, b, float(eps)), post)


def _route_rms_norm(T, input, normalized_shape, weight=None, eps=None):
    """As layer_norm's; eps=None is PyTorch's default, float32's machine epsilon (the
    arithmetic is float32 for every input dtype)."""
    if not input.is_cuda:
        return "not a CUDA tensor"
    dt = T.autocast_dtype("rms_norm", input.dtype)
    reason, x, (w,), post = _norm_args(T, "rms_norm", T.cast(input, dt), normalized_shape, (T.cast(weight, dt),))
    return reason or ("rms_norm", (x, w, T.FLOAT32_EPS if eps is None else float(eps)), post)


FAMILY = Family(
    name="norm",
    api=(layer_norm, layer_norm_backward, rms_norm, rms_norm_backward),
    references={"layer_norm": reference_layer_norm, "layer_norm_backward": reference_layer_norm_backward,
                "rms_norm": reference_rms_norm, "rms_norm_backward": reference_rms_norm_backward},
    instances=instances,
    bench=bench_cases,
    torch_bench=torch_bench_cases,
    torch_ops=TORCH_OPS,
    # Under torch.compile Inductor fuses the norms with the casts and residual adds around them;
    # a custom op blocks that fusion and measured slower in the demo (docs/torch.md).
    # Below 2**20 elements (4 MB of float32) a call waits for the host either way (docs/torch.md).
    dropins=(DropIn("layer_norm", _route_layer_norm, compile=False, probe=lambda f, x: f(x, (8,)), min_size=2**20),
             DropIn("rms_norm", _route_rms_norm, compile=False, probe=lambda f, x: f(x, (8,)), min_size=2**20)),
    modules=(ModuleSpec("LayerNorm", "LayerNorm", "layer_norm",
                        lambda m, x: (x, m.normalized_shape, m.weight, m.bias, m.eps)),
             ModuleSpec("RMSNorm", "RMSNorm", "rms_norm", lambda m, x: (x, m.normalized_shape, m.weight, m.eps))),
)
