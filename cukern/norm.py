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

from . import _arrays, _checks, _kernels, _partials
from ._bench_cases import Case, TorchCase, elements_bytes, generator, randn
from ._arrays import DeviceArray
from ._family import DropIn, Family, ModuleSpec, TorchOp
from ._kernels import Instance, Slot
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

    def instance(self, kind: str, dtype: str, rms: bool, vec: int, offset: bool = False, cast: int = 0,
                 out: str | None = None) -> Instance:
        ctype = _arrays.DTYPES[dtype][0]
        return Instance(SOURCE, f"norm_{kind}<{ctype}, {str(rms).lower()}, {vec}, {self.nv}, {self.g}, "
                                f"{self.threads}, {self.r}, {self.minb}, {_variant(kind, dtype, offset, cast, out)}>",
                        self.threads)


@dataclass(frozen=True)
class LoopConfig:
    """norm_fwd_loop / norm_bwd_loop: rows of any width, one block a row, in chunks."""
    threads: int = 512
    rows_per_block = 1
    groups = 1

    def instance(self, kind: str, dtype: str, rms: bool, vec: int, offset: bool = False, cast: int = 0,
                 out: str | None = None) -> Instance:
        ctype = _arrays.DTYPES[dtype][0]
        return Instance(SOURCE, f"norm_{kind}_loop<{ctype}, {str(rms).lower()}, {vec}, {self.threads}, "
                                f"{_variant(kind, dtype, offset, cast, out)}>", self.threads)


def _variant(kind: str, dtype: str, offset: bool, cast: int, out: str | None) -> str:
    """The trailing template arguments: OFFSET, CAST and (forward) the output type TO."""
    args = f"{str(offset).lower()}, {cast}"
    if kind == "fwd":
        args += f", {_arrays.FP8[out][0] if out else _arrays.DTYPES[dtype][0]}"
    return args


@dataclass(frozen=True, eq=False)   # (hashed by identity: plans are keyed by it, on every call)
class Configs:
    """The row-in-registers configurations of each direction, in order of capacity (the first
    that holds the row is used; wider rows take the looped kernel). Chosen by measurement
    (docs/notes-norm.md); none spills (the compile check)."""
    fwd: tuple[RowConfig, ...]
    bwd: tuple[RowConfig, ...]
    loop: LoopConfig = LoopConfig()
    # the forward with a fused residual, where it differs from fwd (None: fwd's)
    residual: tuple[RowConfig, ...] | None = None

    def table(self, kind: str) -> tuple[RowConfig, ...]:
        """"fwd", "res" (the forward with a residual) or "bwd"."""
        if kind == "res":
            return self.residual or self.fwd
        return self.fwd if kind == "fwd" else self.bwd

    def pick(self, kind: str, cols: int, vec: int) -> RowConfig | LoopConfig:
        nvec = -(-cols // vec)
        for c in self.table(kind):
            if c.capacity >= nvec:
                return c
        return self.loop


_FWD_ROWS = (RowConfig(1, 4, 128), RowConfig(1, 16, 128), RowConfig(1, 32, 128, 2), RowConfig(2, 32, 128, 2),
             RowConfig(4, 32, 128), RowConfig(2, 128, 128), RowConfig(4, 128, 128, 2, 5), RowConfig(4, 256, 256),
             RowConfig(4, 512, 512))
CONFIGS = Configs(
    fwd=_FWD_ROWS,
    bwd=(RowConfig(1, 4, 128), RowConfig(1, 16, 128), RowConfig(1, 32, 128), RowConfig(2, 32, 128, 1, 6),
         RowConfig(4, 32, 128, 1, 4), RowConfig(2, 128, 128, 1, 6), RowConfig(4, 128, 128, 1, 4),
         RowConfig(4, 256, 256, 1, 2)),
    # (two rows a group lost a tenth with a residual at 4096 columns: one row, 8 blocks an SM)
    residual=_FWD_ROWS[:6] + (RowConfig(4, 128, 128, 1, 8),) + _FWD_ROWS[7:],
)


# RMSNorm's casting modes (the CAST template argument; cuda_src/norm.cu says what each rounds).
# Their backward is one: "llama" and "none" differ in the forward's rstd alone.
CASTING_MODES = {"gemma": 0, "llama": 1, "none": 2}


def _variants(kind: str, dtype: str, rms: bool) -> list[tuple[int, str | None]]:
    """(cast, fp8 output) of the variants beside the plain one: the casting modes (RMSNorm,
    16-bit inputs) and the fp8 outputs (forward)."""
    out = []
    if rms and _arrays.DTYPES[dtype][1] == 2:
        out += [(c, None) for c in ((1, 2) if kind == "fwd" else (1,))]
    if kind == "fwd":
        out += [(0, f) for f in _arrays.FP8]
    return out


def instances(configs: Configs = CONFIGS) -> list[Instance]:
    """Every kernel instance the fronts can launch (for the compile check). The variants
    (casting modes, fp8 output) of rows that take scalar loads run the looped kernel."""
    out = []
    for dtype, (_, itemsize) in _arrays.DTYPES.items():
        for rms in (False, True):
            for vec in sorted({1, 16 // itemsize}):
                for kind in ("fwd", "res", "bwd"):
                    table = configs.table(kind)
                    k = "bwd" if kind == "bwd" else "fwd"
                    out += [c.instance(k, dtype, rms, vec, offset) for c in (*table, configs.loop)
                            for offset in (False, True)]
                    cfgs = (*table, configs.loop) if vec > 1 else (configs.loop,)
                    out += [c.instance(k, dtype, rms, vec, offset, cast, fp8) for cast, fp8 in
                            _variants(k, dtype, rms) for c in cfgs for offset in (False, True)]
    return list(dict.fromkeys(out))   # (the residual table repeats most of fwd's)


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
    plan = _FWD.get(key) or _FWD.put(key, _plan_forward(rms, arrays, eps, bool(return_stats), configs, off, cast,
                                                        out))
    bufs = plan(arrays)
    # bufs: x, weight, bias, residual, scale, amax, then y, h (residual), mean (LayerNorm,
    # stats), rstd (stats)
    out = [b.obj for b in bufs[6:]]
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
    y = b.alloc(xa.shape, out or xa.dtype)
    h = b.alloc(xa.shape, xa.dtype) if ra is not None else None
    mean = b.alloc(lead, "float32") if return_stats and not rms else None
    rstd = b.alloc(lead, "float32") if return_stats else None
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
        cfg = configs.loop if variant and vec == 1 else configs.pick("fwd" if ra is None else "res", cols, vec)
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
    return _forward(False, x, weight, bias, eps, residual, return_stats, CONFIGS, offset, "gemma", out_dtype,
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
    return _forward(True, x, weight, None, eps, residual, return_stats, CONFIGS, offset, casting_mode, out_dtype,
                    scale, amax)


# ---- backward -------------------------------------------------------------------------------

_BWD = PlanCache()


def _backward(rms: bool, dy, x, weight, mean, rstd, dresidual, configs: Configs, offset=0.0, casting_mode="gemma"):
    arrays = [_arrays.as_device_array(dy, "dy"), _arrays.as_device_array(x, "x"), _optional(weight, "weight"),
              None if rms else _arrays.as_device_array(mean, "mean", ("float32",)),
              _arrays.as_device_array(rstd, "rstd", ("float32",)), _optional(dresidual, "dresidual")]
    off = _offset(offset, weight)
    cast = min(_casting(casting_mode, rms), 1)   # ("none" and "llama" share the backward)
    key = (rms, off, cast, configs, *(a and a.key for a in arrays))
    plan = _BWD.get(key) or _BWD.put(key, _plan_backward(rms, arrays, configs, off, cast))
    bufs = plan(arrays)
    # bufs: dy, x, weight, mean, rstd, dresidual, then dx, dw, db (or None), scratch
    return bufs[6].obj, bufs[7] and bufs[7].obj, bufs[8] and bufs[8].obj


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
    dx = b.alloc(xa.shape, xa.dtype)
    dw = b.alloc((cols,), xa.dtype) if wa is not None else b.absent()
    db = b.alloc((cols,), xa.dtype) if not rms else b.absent()
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
    return _backward(False, dy, x, weight, mean, rstd, dresidual, CONFIGS, offset)


def rms_norm_backward(dy, x, weight, rstd, *, dresidual=None, offset=0.0, casting_mode="gemma"):
    """Gradients of ``rms_norm``: ``(dx, dweight)``; see ``layer_norm_backward``. casting_mode:
    the forward's. In "llama" and "none", ``dy * weight`` is rounded to x's dtype and dweight
    sums ``dy * xhat`` with xhat rounded, as autograd through Hugging Face's LlamaRMSNorm."""
    dx, dw, _ = _backward(True, dy, x, weight, None, rstd, dresidual, CONFIGS, offset, casting_mode)
    return dx, dw


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


# ---- benchmark cases ----------------------------------------------------------------------------

# The workload: rows of the model dim 4096 for a batch of 32 x 2048 tokens.
WORKLOAD = {"full": (65536, 4096), "quick": (8192, 4096), "dtype": "bfloat16"}


def _inputs(shape, dtype, seed, *, bias, grad=False, residual=False) -> dict:
    gen = generator(seed)
    d = shape[-1]
    t = {"x": randn(shape, dtype, gen), "w": randn((d,), dtype, gen),
         "b": randn((d,), dtype, gen) if bias else None}
    if residual:
        t["r"] = randn(shape, dtype, gen)
    if grad:
        t["dy"] = randn(shape, dtype, gen)
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


def _fp8_inputs(shape, dtype, seed, *, bias) -> dict:
    import torch

    t = _inputs(shape, dtype, seed, bias=bias)
    t["scale"] = torch.full((1,), 64.0, device="cuda")
    t["amax"] = torch.zeros(1, device="cuda")
    return t


def _fp8(rms, t):
    out = dict(out_dtype="float8_e4m3fn", scale=t["scale"], amax=t["amax"])
    y = rms_norm(t["x"], t["w"], **out) if rms else layer_norm(t["x"], t["w"], t["b"], **out)
    return y, t["amax"]


def _torch_fp8(rms, t):
    """PyTorch's norm, its amax, and the scaled, saturated cast (TransformerEngine's contract)."""
    import torch

    y = _torch_fwd(rms, t)
    y8 = (y.float() * t["scale"]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return y8, y.abs().amax().float().reshape(1)


def bench_cases(quick: bool) -> list:
    """(N, D); bytes in passes of N*D elements: fwd 2 (x, y), fwd+bwd 5 (+ dy, x, dx), fused
    residual 4 (x, r in; y, h out). Weights and statistics are O(N + D), left out."""
    nd, dt = WORKLOAD["quick" if quick else "full"], WORKLOAD["dtype"]
    p = functools.partial
    cases = []
    for rms, name in ((False, "layer_norm"), (True, "rms_norm")):
        make = p(_inputs, nd, dt, bias=not rms)
        cases += [
            Case(f"{name} fwd", "norm", nd, dt, elements_bytes(nd, dt, 2), make, p(_fwd, rms),
                        p(_torch_fwd, rms)),
            Case(f"{name} fwd+bwd", "norm", nd, dt, elements_bytes(nd, dt, 5), p(make, grad=True),
                        p(_fwd_bwd, rms), p(_torch_fwd_bwd, rms)),
        ]
    for rms, name in ((False, "layer_norm"), (True, "rms_norm")):
        cases.append(Case(f"{name} +residual fwd", "norm", nd, dt, elements_bytes(nd, dt, 4),
                                 p(_inputs, nd, dt, bias=not rms, residual=True), p(_res, rms), p(_torch_res, rms)))
    # fp8 output (e4m3 with its amax): read 2 bytes an element, write 1
    for rms, name in ((False, "layer_norm"), (True, "rms_norm")):
        cases.append(Case(f"{name} fwd fp8", "norm", nd, dt, elements_bytes(nd, dt, 1.5),
                                 p(_fp8_inputs, nd, dt, bias=not rms), p(_fp8, rms), p(_torch_fp8, rms)))
    # (the order of the table as before: fwd, fwd, fwd+bwd, fwd+bwd, residual, residual)
    return [cases[0], cases[2], cases[1], cases[3], cases[4], cases[5], cases[6], cases[7]]


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
        cases.append(TorchCase(f"{name} fwd+bwd", "norm", nd, dt, elements_bytes(nd, dt, 5), make,
                                      p(_forward_on, rms=rms), p(_fwd_bwd, rms), liger=p(_liger, rms)))
    cases.append(TorchCase("rms_norm fwd", "norm", nd, dt, elements_bytes(nd, dt, 2),
                                  p(_inputs, nd, dt, bias=False, grad=True), p(_forward_on, rms=True),
                                  p(_fwd, True), liger=p(_liger, True), backward=False))
    return cases


# ---- PyTorch bindings -------------------------------------------------------------------------
# The ops carry the variants as arguments (offset: a float; casting: CASTING_MODES' int), so
# that one op serves the drop-ins (0.0, 0) and the modules' options. The fused-residual ops
# return (y, h) and their backward gives dx to both x and the residual (h = x + residual).

_CAST_NAMES = {v: k for k, v in CASTING_MODES.items()}


def _stats_like(x, n: int) -> tuple:
    import torch

    return tuple(x.new_empty(x.shape[:-1], dtype=torch.float32) for _ in range(n))


def _out_like(x):
    import torch

    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _ln_fake(x, weight, bias, eps, offset):
    return (_out_like(x), *_stats_like(x, 2))


def _ln_res_fake(x, residual, weight, bias, eps, offset):
    return (_out_like(x), _out_like(x), *_stats_like(x, 2))


def _ln_bwd_fake(dy, x, weight, mean, rstd, offset):
    d = x.shape[-1]
    return _out_like(x), x.new_empty((d,) if weight is not None else (0,)), x.new_empty((d,))


def _ln_res_bwd_fake(dy, dh, h, weight, mean, rstd, offset):
    return _ln_bwd_fake(dy, h, weight, mean, rstd, offset)


def _rms_fake(x, weight, eps, offset, casting):
    return (_out_like(x), *_stats_like(x, 1))


def _rms_res_fake(x, residual, weight, eps, offset, casting):
    return (_out_like(x), _out_like(x), *_stats_like(x, 1))


def _rms_bwd_fake(dy, x, weight, rstd, offset, casting):
    return _out_like(x), x.new_empty((x.shape[-1],) if weight is not None else (0,))


def _rms_res_bwd_fake(dy, dh, h, weight, rstd, offset, casting):
    return _rms_bwd_fake(dy, h, weight, rstd, offset, casting)


def _ln_bwd(dy, x, w, mean, rstd, offset, dh=None):
    return layer_norm_backward(dy, x, w, mean, rstd, dresidual=dh, offset=offset)


def _rms_bwd(dy, x, w, rstd, offset, casting, dh=None):
    return rms_norm_backward(dy, x, w, rstd, dresidual=dh, offset=offset, casting_mode=_CAST_NAMES[casting])


TORCH_OPS = (
    TorchOp("layer_norm", "(Tensor x, Tensor? weight, Tensor? bias, float eps, float offset) "
                          "-> (Tensor, Tensor, Tensor)",
            forward=lambda x, w, b, eps, off: layer_norm(x, w, b, eps, return_stats=True, offset=off),
            inference=lambda x, w, b, eps, off: layer_norm(x, w, b, eps, offset=off),
            fake=_ln_fake,
            save=lambda inputs, outputs: ((inputs[0], inputs[1], outputs[1], outputs[2]), inputs[4]),
            backward_schema="(Tensor dy, Tensor x, Tensor? weight, Tensor mean, Tensor rstd, float offset) "
                            "-> (Tensor, Tensor, Tensor)",
            backward=_ln_bwd, backward_fake=_ln_bwd_fake,
            backward_args=lambda saved, state, grads, T: (grads[0], *saved, state), grads_to=(0, 1, 2), native=True),
    TorchOp("rms_norm", "(Tensor x, Tensor? weight, float eps, float offset, int casting) -> (Tensor, Tensor)",
            forward=lambda x, w, eps, off, c: rms_norm(x, w, eps, return_stats=True, offset=off,
                                                       casting_mode=_CAST_NAMES[c]),
            inference=lambda x, w, eps, off, c: rms_norm(x, w, eps, offset=off, casting_mode=_CAST_NAMES[c]),
            fake=_rms_fake,
            save=lambda inputs, outputs: ((inputs[0], inputs[1], outputs[1]), inputs[3:5]),
            backward_schema="(Tensor dy, Tensor x, Tensor? weight, Tensor rstd, float offset, int casting) "
                            "-> (Tensor, Tensor)",
            backward=_rms_bwd, backward_fake=_rms_bwd_fake,
            backward_args=lambda saved, state, grads, T: (grads[0], *saved, *state), grads_to=(0, 1), native=True),
    # h = x + residual and the norm of h in one pass; dx goes to x and to the residual alike
    TorchOp("layer_norm_residual", "(Tensor x, Tensor residual, Tensor? weight, Tensor? bias, float eps, "
                                   "float offset) -> (Tensor, Tensor, Tensor, Tensor)",
            forward=lambda x, r, w, b, eps, off: layer_norm(x, w, b, eps, residual=r, return_stats=True, offset=off),
            inference=lambda x, r, w, b, eps, off: layer_norm(x, w, b, eps, residual=r, offset=off),
            fake=_ln_res_fake, visible=2,
            save=lambda inputs, outputs: ((outputs[1], inputs[2], outputs[2], outputs[3]), inputs[5]),
            backward_schema="(Tensor dy, Tensor? dh, Tensor h, Tensor? weight, Tensor mean, Tensor rstd, "
                            "float offset) -> (Tensor, Tensor, Tensor)",
            backward=lambda dy, dh, h, w, m, r, off: _ln_bwd(dy, h, w, m, r, off, dh),
            backward_fake=_ln_res_bwd_fake,
            backward_args=lambda saved, state, grads, T: (grads[0], grads[1], *saved, state),
            grads_to=((0, 1), 2, 3), native=True),
    TorchOp("rms_norm_residual", "(Tensor x, Tensor residual, Tensor? weight, float eps, float offset, "
                                 "int casting) -> (Tensor, Tensor, Tensor)",
            forward=lambda x, r, w, eps, off, c: rms_norm(x, w, eps, residual=r, return_stats=True, offset=off,
                                                          casting_mode=_CAST_NAMES[c]),
            inference=lambda x, r, w, eps, off, c: rms_norm(x, w, eps, residual=r, offset=off,
                                                            casting_mode=_CAST_NAMES[c]),
            fake=_rms_res_fake, visible=2,
            save=lambda inputs, outputs: ((outputs[1], inputs[2], outputs[2]), inputs[4:6]),
            backward_schema="(Tensor dy, Tensor? dh, Tensor h, Tensor? weight, Tensor rstd, float offset, "
                            "int casting) -> (Tensor, Tensor)",
            backward=lambda dy, dh, h, w, r, off, c: _rms_bwd(dy, h, w, r, off, c, dh),
            backward_fake=_rms_res_bwd_fake,
            backward_args=lambda saved, state, grads, T: (grads[0], grads[1], *saved, *state),
            grads_to=((0, 1), 2), native=True),
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
    return reason or ("layer_norm", (x, w, b, float(eps), 0.0), post)


def _route_rms_norm(T, input, normalized_shape, weight=None, eps=None):
    """As layer_norm's; eps=None is PyTorch's default, float32's machine epsilon (the
    arithmetic is float32 for every input dtype)."""
    if not input.is_cuda:
        return "not a CUDA tensor"
    dt = T.autocast_dtype("rms_norm", input.dtype)
    reason, x, (w,), post = _norm_args(T, "rms_norm", T.cast(input, dt), normalized_shape, (T.cast(weight, dt),))
    return reason or ("rms_norm", (x, w, T.FLOAT32_EPS if eps is None else float(eps), 0.0, 0), post)


# ---- the variants and the fused residual under cukern.torch ---------------------------------------

def _torch_norm(rms, x, shape, w, b, eps, offset, cast):
    """The variants in PyTorch's own ops (tensors the kernels do not take, and torch.compile,
    where Inductor fuses them with what is around): the kernels' arithmetic and roundings."""
    import torch

    dims = tuple(range(-len(shape), 0))
    h = x.float()
    if rms:
        r = torch.rsqrt(h.pow(2).mean(dims, keepdim=True) + eps)
        if cast == 2:
            r = r.to(x.dtype).float()
        y = h * r
    else:
        # The mean shifted by the row's first element, as the kernels do: a row of equal elements
        # has mean == that element and variance 0 exactly (a float32 sum / D rounds).
        k = h[(...,) + (slice(0, 1),) * len(dims)]
        d = h - (k + (h - k).mean(dims, keepdim=True))
        y = d * torch.rsqrt(d.pow(2).mean(dims, keepdim=True) + eps)
    if cast:
        y = y.to(x.dtype).float()
    if w is not None:
        y = y * (w.float() + offset)
    if b is not None:
        y = y + b.float()
    return y.to(x.dtype)


def _norm_call(T, ops, rms, x, residual, shape, w, b, eps, offset, cast):
    """y, or (y, h) with a residual (h = x + residual), on the kernels where they take the call
    (``T``: cukern.torch._tools, ``ops``: the TorchOps by name)."""
    op = "rms_norm" if rms else "layer_norm"
    if eps is None:
        eps = T.FLOAT32_EPS
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if x.is_cuda:
        dt = T.autocast_dtype(op, x.dtype)
        x, residual, w, b = (T.cast(t, dt) for t in (x, residual, w, b))
    reason = "compiling" if T.compiling() else None
    if reason is None and residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                                    or residual.device != x.device):
        reason = "residual differs from x in shape, dtype or device"
    if reason is None:
        reason, xk, params, post = _norm_args(T, op, x, shape, (w,) if rms else (w, b))
    if reason is not None:
        if residual is None:
            return _torch_norm(rms, x, shape, w, b, float(eps), offset, cast)
        h = x + residual
        return _torch_norm(rms, h, shape, w, b, float(eps), offset, cast), h
    tail = (float(eps), float(offset)) + ((int(cast),) if rms else ())
    if residual is None:
        out = ops[op](xk, *params, *tail)
        return out if post is None else post(out)
    rk = residual if post is None else residual.reshape(xk.shape)
    y, h = ops[op + "_residual"](xk, rk, *params, *tail)
    return (y, h) if post is None else (post(y), post(h))


def _options(m, rms: bool) -> tuple:
    """(offset, cast) of a module, checked."""
    off = _offset(m.offset, m.weight)
    return off, (_casting(m.casting_mode, True) if rms else 0)


def _init_variant(m) -> None:
    """A module with an offset starts with the weight it applies at 1: its weight at 1 - offset
    (Gemma's zeros for offset 1, as TransformerEngine's zero-centred gamma)."""
    import torch

    _options(m, hasattr(m, "casting_mode"))
    if m.weight is not None and m.offset:
        with torch.no_grad():
            m.weight.fill_(1.0 - float(m.offset))


def _module_forward(rms: bool):
    def forward(T, ops, m, x, residual=None):
        off, cast = _options(m, rms)
        return _norm_call(T, ops, rms, x, residual, m.normalized_shape, m.weight, None if rms else m.bias, m.eps, off,
                          cast)
    return forward


def _torch_api(T, ops, modules) -> dict:
    """``FusedAddRMSNorm`` / ``FusedAddLayerNorm`` (subclasses of the drop-in modules) and
    ``fused_add_rms_norm`` / ``fused_add_layer_norm``."""
    def fused_add_rms_norm(x, residual, weight=None, eps=None, *, offset=0.0, casting_mode="gemma"):
        """``h = x + residual`` (rounded to the dtype) and ``rms_norm(h)`` in one pass: ``(y, h)``,
        with autograd (dx reaches x and residual alike) and torch.compile. x, residual (*, D);
        weight (D,) or None; offset and casting_mode as ``cukern.rms_norm``."""
        off = _offset(offset, weight)
        return _norm_call(T, ops, True, x, residual, x.shape[-1:], weight, None, eps, off, _casting(casting_mode, True))

    def fused_add_layer_norm(x, residual, weight=None, bias=None, eps=1e-5, *, offset=0.0):
        """``h = x + residual`` and ``layer_norm(h)`` in one pass: ``(y, h)``; see
        ``fused_add_rms_norm``."""
        off = _offset(offset, weight)
        return _norm_call(T, ops, False, x, residual, x.shape[-1:], weight, bias, eps, off, 0)

    def fused(name: str, rms: bool) -> type:
        base = modules[name]
        fwd = _module_forward(rms)

        def forward(self, x, residual):
            return fwd(T, ops, self, x, residual)

        doc = (f"``cukern.torch.{name}`` whose ``forward(x, residual)`` returns ``(y, h)``: ``h = x + residual`` "
               f"(the residual stream, rounded to the dtype) and y its norm, in one pass, with autograd (dx "
               f"reaches x and residual alike). Same constructor (offset{', casting_mode' if rms else ''} "
               f"included), parameters and state_dict as ``torch.nn.{name}``.")
        return type(f"FusedAdd{name}", (base,), {"forward": forward, "__doc__": doc, "__module__": "cukern.torch"})

    return {"fused_add_rms_norm": fused_add_rms_norm, "fused_add_layer_norm": fused_add_layer_norm,
            "FusedAddRMSNorm": fused("RMSNorm", True), "FusedAddLayerNorm": fused("LayerNorm", False)}


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
                        lambda m, x: (x, m.normalized_shape, m.weight, m.bias, m.eps),
                        options=(("offset", 0.0),), variant=_module_forward(False), init=_init_variant),
             ModuleSpec("RMSNorm", "RMSNorm", "rms_norm", lambda m, x: (x, m.normalized_shape, m.weight, m.eps),
                        options=(("offset", 0.0), ("casting_mode", "gemma")), variant=_module_forward(True),
                        init=_init_variant)),
    torch_api=_torch_api,
)
