"""GroupNorm over (N, C, *spatial), forward and backward (kernels: cuda_src/group_norm.cu).

Shapes: ``x`` is (N, C, *spatial) (spatial may be empty); C is split into ``num_groups``
groups of C / num_groups channels, and each (sample, group) is normalized over its channels
and all spatial positions, as ``torch.nn.functional.group_norm``. ``weight`` and ``bias``
are (C,). Statistics (mean, rstd) are float32 of shape (N, num_groups).
Layouts: contiguous (N, C, *spatial), and channels-last — an (N, C, *spatial) array whose
memory is a dense (N, *spatial, C), like torch's ``channels_last`` — are read in place, and
the output has the input's layout. Any other strides are copied to contiguous first.
dtypes: float32, float16, bfloat16, one dtype for all array arguments; arithmetic float32.
"""
from __future__ import annotations

import math
import operator

import numpy as np

from . import _arrays, _kernels, _partials
from ._arrays import DeviceArray
from .norm import _check_eps, _check_like

__all__ = ["group_norm", "group_norm_backward"]

SOURCE = "group_norm.cu"

# (threads a block, vectors a thread loads before it uses them, MINB of __launch_bounds__,
# blocks in flight an SM) by direction and layout (channels-last or not). Each block works on
# one group at a time and reads it twice; the second read should come from L2, so the groups
# in flight must fit in it. Measured: docs/notes-group-norm.md. None spills (test_compile).
CONFIGS = {
    ("fwd", False): (512, 8, 1, 1),
    ("fwd", True): (1024, 2, 1, 1),
    ("bwd", False): (512, 4, 1, 1),
    ("bwd", True): (512, 2, 1, 2),
}
TASK_SLOTS = 256  # shared-memory slots for channel segments (CL = false), group_norm.cu


# Channels-last tiles of several groups (GT of group_norm.cu): a tile of GT groups is read as
# rows of GT*Cg channels, which DRAM serves far better than rows of Cg (32 bytes at the
# workload shape): docs/notes-group-norm.md. The widest tile is used whose row is at most 32
# vectors and that leaves at least CL_TILES_PER_SM tiles an SM (4 groups a tile at the
# workload shape: 128 tiles on 132 SMs, still 1.5x faster than 2 groups a tile on 256).
CL_TILE_GROUPS = (4, 2)
CL_TILES_PER_SM = 0.5


def _instance(kind: str, ctype: str, cl: bool, gt: int, vec: int) -> tuple[str, tuple]:
    threads, unroll, minb, per_sm = CONFIGS.get((kind, cl, ctype), CONFIGS[(kind, cl)])
    name = (f"group_norm_{kind}<{ctype}, {'true' if cl else 'false'}, {gt}, {vec}, {threads}, "
            f"{unroll}, {minb}>")
    return name, (threads, per_sm)


def instances() -> list[str]:
    """Every kernel instance the fronts below can launch (for the compile check)."""
    names = []
    for ctype, itemsize in _arrays.DTYPES.values():
        for cl in (False, True):
            for gt in ((1,) + CL_TILE_GROUPS if cl else (1,)):
                for vec in sorted({1, 16 // itemsize}):
                    for kind in ("fwd", "bwd"):
                        names.append(_instance(kind, ctype, cl, gt, vec)[0])
    return names


# ---- argument checking ----------------------------------------------------------------------

def _check_x(x, name: str) -> DeviceArray:
    xa = _arrays.as_device_array(x, name)
    if xa.ndim < 2:
        raise ValueError(f"{name}: expected (N, C, *spatial) with at least 2 axes, got shape {xa.shape}")
    return xa


def _check_limits(xa: DeviceArray) -> None:
    """The kernels take N, C and per-channel extents as 32-bit ints."""
    n, c = xa.shape[:2]
    hw = math.prod(xa.shape[2:])
    for what, value in (("N", n), ("C", c), ("the spatial size", hw)):
        if value >= 2**31:
            raise ValueError(f"{xa.name}: {what} = {value} is beyond the kernels' 32-bit range "
                             f"(shape {xa.shape}); split the tensor")


def _check_groups(num_groups, channels: int) -> int:
    try:
        g = operator.index(num_groups)
    except TypeError:
        raise TypeError(f"num_groups: expected an int, got {type(num_groups).__name__}") from None
    if g <= 0:
        raise ValueError(f"num_groups: must be positive, got {g}")
    if channels % g:
        raise ValueError(f"num_groups: {channels} channels cannot be split into {g} equal groups "
                         f"(C = {channels} is not divisible by num_groups = {g})")
    return g


def _check_stats(arr, name: str, n: int, g: int) -> DeviceArray:
    a = _arrays.as_device_array(arr, name, dtypes=("float32",))
    if a.shape not in ((n, g), (n * g,)):
        raise ValueError(f"{name}: shape {a.shape} does not match (N, num_groups) = {(n, g)}")
    return a.contiguous()


def _layout(xa: DeviceArray) -> tuple[DeviceArray, bool]:
    """(array, channels_last): the input as the kernels can read it, copying only when the
    strides are neither contiguous nor channels-last."""
    if _arrays.is_contiguous(xa):
        return xa, False
    if _arrays.is_channels_last(xa):
        return xa, True
    return xa.contiguous(), False


def _in_layout(a: DeviceArray, channels_last: bool) -> DeviceArray:
    if channels_last:
        return _arrays.channels_last(a)
    return a if _arrays.is_contiguous(a) else a.contiguous()


def _empty_like_layout(xa: DeviceArray, channels_last: bool) -> DeviceArray:
    if channels_last:
        return _arrays.empty_channels_last(xa, xa.shape)
    return _arrays.empty(xa, xa.shape)


def _geometry(xa: DeviceArray, channels_last: bool, g: int, threads: int, arrays, device: int):
    """Vector width, groups a tile, and the kernel's geometry arguments (seg, seg_len, tcv)."""
    n, c = xa.shape[:2]
    hw = math.prod(xa.shape[2:])
    cg = c // g
    vec = 16 // xa.itemsize
    unit = cg if channels_last else hw  # length of the unit-stride runs
    if unit % vec or any(a.ptr % 16 for a in arrays if a is not None):
        vec = 1
    warps = threads // 32
    if channels_last:
        gt = 1
        for t in CL_TILE_GROUPS:
            if g % t == 0 and t * cg // vec <= 32 and n * g // t >= CL_TILES_PER_SM * _kernels.sm_count(device):
                gt = t
                break
        ctv = gt * cg // vec
        tcv = min(32, 1 << (ctv - 1).bit_length())
        return vec, gt, (1, 1, tcv)
    hwv = hw // vec
    seg = 1
    if cg < warps:  # cut channel rows so that every warp has work, each piece >= 32 vectors
        seg = max(1, min(-(-warps // cg), hwv // 32, TASK_SLOTS // cg))
    return vec, 1, (seg, -(-hwv // seg), 1)


def _grid(fn, threads: int, per_sm: int, tiles: int, device: int) -> int:
    return max(1, min(tiles, _kernels.sm_count(device) * per_sm,
                      _kernels.resident_blocks(fn, threads, device)))


# ---- forward --------------------------------------------------------------------------------

def group_norm(x, num_groups, weight=None, bias=None, eps=1e-5, *, return_stats=False):
    """GroupNorm: each (sample, group) normalized over its channels and spatial positions,
    ``(x - mean) / sqrt(var + eps) * weight[c] + bias[c]`` (biased variance).

    Args:
        x: (N, C, *spatial) float32, float16 or bfloat16 (CuPy array or torch CUDA tensor),
            contiguous or channels-last.
        num_groups: divides C.
        weight, bias: (C,) of x's dtype, or None.
        eps: added to the variance.
        return_stats: also return mean and rstd, float32 (N, num_groups).

    Returns:
        ``y`` with x's shape and layout, or ``(y, mean, rstd)``.
    """
    xa = _check_x(x, "x")
    _check_limits(xa)
    n, c = xa.shape[:2]
    g = _check_groups(num_groups, c)
    wa = _check_like(weight, "weight", xa, (c,))
    ba = _check_like(bias, "bias", xa, (c,))
    epsf = _check_eps(eps)
    device = _arrays.same_device(xa, wa, ba)
    wa = wa.contiguous() if wa is not None else None
    ba = ba.contiguous() if ba is not None else None
    hw = math.prod(xa.shape[2:])
    groups = n * g
    group_size = c // g * hw

    xa, cl = _layout(xa)
    y = _empty_like_layout(xa, cl)
    mean = _arrays.empty(xa, (n, g), "float32") if return_stats else None
    rstd = _arrays.empty(xa, (n, g), "float32") if return_stats else None
    with _arrays.launch_context(xa):
        if groups and group_size:
            threads = _instance("fwd", xa.ctype, cl, 1, 1)[1][0]
            vec, gt, (seg, seg_len, tcv) = _geometry(xa, cl, g, threads, (xa, y, wa, ba), device)
            inst, (threads, per_sm) = _instance("fwd", xa.ctype, cl, gt, vec)
            fn = _kernels.function(SOURCE, inst, device)
            tiles = groups // gt
            grid = _grid(fn, threads, per_sm, tiles, device)
            _kernels.launch(fn, grid, threads, (
                xa, wa, ba, y, mean, rstd, np.int32(c), np.int32(g), np.int64(hw), np.int32(seg),
                np.int32(seg_len), np.int32(tcv), np.int64(tiles), epsf))
        elif groups and return_stats:  # empty groups: nothing to normalize
            _arrays.fill(mean, 0.0)
            _arrays.fill(rstd, float(1.0 / np.sqrt(epsf)) if epsf > 0 else float("inf"))
    if return_stats:
        return y.obj, mean.obj, rstd.obj
    return y.obj


# ---- backward -------------------------------------------------------------------------------

def group_norm_backward(dy, x, num_groups, weight, mean, rstd):
    """Gradients of ``group_norm``.

    Args:
        dy: (N, C, *spatial) gradient of the output, x's dtype (any layout; it is read in
            x's layout, copied into it if it differs).
        x: the forward's input.
        num_groups: as in the forward.
        weight: (C,) or None, as in the forward.
        mean, rstd: float32 (N, num_groups) from ``group_norm(..., return_stats=True)``.

    Returns:
        ``(dx, dweight, dbias)``: dx with x's shape and layout; dweight (C,) or None when
        weight is None; dbias (C,). Bitwise deterministic (no atomics).
    """
    xa = _check_x(x, "x")
    _check_limits(xa)
    da = _check_like(dy, "dy", xa, xa.shape, required=True)
    n, c = xa.shape[:2]
    g = _check_groups(num_groups, c)
    wa = _check_like(weight, "weight", xa, (c,))
    ma = _check_stats(mean, "mean", n, g)
    sa = _check_stats(rstd, "rstd", n, g)
    device = _arrays.same_device(xa, da, wa, ma, sa)
    wa = wa.contiguous() if wa is not None else None
    hw = math.prod(xa.shape[2:])
    groups = n * g
    group_size = c // g * hw

    xa, cl = _layout(xa)
    da = _in_layout(da, cl)
    dx = _empty_like_layout(xa, cl)
    with _arrays.launch_context(xa):
        if not (groups and group_size):
            dw = _arrays.zeros(xa, (c,)) if wa is not None else None
            db = _arrays.zeros(xa, (c,))
        else:
            threads = _instance("bwd", xa.ctype, cl, 1, 1)[1][0]
            vec, gt, (seg, seg_len, tcv) = _geometry(xa, cl, g, threads, (xa, da, dx), device)
            inst, (threads, per_sm) = _instance("bwd", xa.ctype, cl, gt, vec)
            fn = _kernels.function(SOURCE, inst, device)
            tiles = groups // gt
            grid = _grid(fn, threads, per_sm, tiles, device)
            dw_part = _arrays.empty(xa, (n, c), "float32")
            db_part = _arrays.empty(xa, (n, c), "float32")
            _kernels.launch(fn, grid, threads, (
                da, xa, wa, ma, sa, dx, dw_part, db_part, np.int32(c), np.int32(g), np.int64(hw),
                np.int32(seg), np.int32(seg_len), np.int32(tcv), np.int64(tiles)))
            dw = _partials.sum_rows(dw_part, xa, n, c, device) if wa is not None else None
            db = _partials.sum_rows(db_part, xa, n, c, device)
    return dx.obj, (dw.obj if dw is not None else None), db.obj
