"""GroupNorm over (N, C, *spatial), forward and backward (kernels: cuda_src/group_norm.cu).

Shapes: ``x`` is (N, C, *spatial) (spatial may be empty); C is split into ``num_groups``
groups of C / num_groups channels, and each (sample, group) is normalized over its channels
and all spatial positions, as ``torch.nn.functional.group_norm``. ``weight`` and ``bias``
are (C,). Statistics (mean, rstd) are float32 of shape (N, num_groups).
Layouts: contiguous (N, C, *spatial), and channels-last — an (N, C, *spatial) array whose
memory is a dense (N, *spatial, C), like torch's ``channels_last`` — are read in place, and
the output has the input's layout. Any other strides are copied to contiguous first.
dtypes: float32, float16, bfloat16, one dtype for all array arguments; arithmetic float32.

The whole Python side of the family: configurations, array functions with launch plans, the
NumPy references, benchmark cases and PyTorch bindings (``FAMILY`` at the end).
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
from ._kernels import Instance
from ._plans import Builder, Plan, PlanCache

__all__ = ["group_norm", "group_norm_backward"]

SOURCE = "group_norm.cu"


# ---- kernel configurations --------------------------------------------------------------------

@dataclass(frozen=True)
class Config:
    """One direction and layout: ``threads`` a block, ``unroll`` vectors a thread loads before
    it uses them, ``minb`` of __launch_bounds__, and ``per_sm`` blocks in flight an SM. Each
    block works on one group (tile) at a time and reads it twice; the second read should come
    from L2, so the groups in flight must fit in it. Measured: docs/notes-group-norm.md."""
    threads: int
    unroll: int
    minb: int = 1
    per_sm: int = 1

    def instance(self, kind: str, dtype: str, channels_last: bool, gt: int, vec: int) -> Instance:
        ctype = _arrays.DTYPES[dtype][0]
        return Instance(SOURCE, f"group_norm_{kind}<{ctype}, {str(channels_last).lower()}, {gt}, {vec}, "
                                f"{self.threads}, {self.unroll}, {self.minb}>", self.threads)


@dataclass(frozen=True, eq=False)   # (hashed by identity: plans are keyed by it, on every call)
class Configs:
    """Configurations by direction and layout, and the channels-last tiling: a tile of
    ``tile_groups`` adjacent groups is read as rows of that many groups' channels, which DRAM
    serves far better than rows of one group's (32 bytes at the workload shape); the widest
    tile is used whose row is at most 32 vectors and that leaves at least ``tiles_per_sm``
    tiles an SM (4 groups a tile at the workload shape: 128 tiles on 132 SMs, still 1.5x
    faster than 2 groups a tile on 256)."""
    fwd: Config = Config(512, 8)
    fwd_cl: Config = Config(1024, 2)
    bwd: Config = Config(512, 4)
    bwd_cl: Config = Config(512, 2, 1, 2)
    tile_groups: tuple[int, ...] = (4, 2)
    tiles_per_sm: float = 0.5
    # The contiguous forward with the whole group in shared memory (group_norm_fwd_staged): at
    # most this many threads a block, 0 for off. A group takes the smallest of STAGED_SMEM that
    # holds it within the device's opt-in; larger groups, and unaligned ones, the two-read kernel.
    fwd_staged: int = 1024

    def get(self, kind: str, channels_last: bool) -> Config:
        return getattr(self, kind + ("_cl" if channels_last else ""))


CONFIGS = Configs()
TASK_SLOTS = 256  # shared-memory slots for channel segments (CL = false), group_norm.cu
STAGED_SMEM = (32 << 10, 64 << 10, 96 << 10, 128 << 10, 192 << 10)   # the staged forward's buffer sizes
_STAGED_SLACK = 1024   # the staged kernel's static shared memory (the block reduction), rounded up


def staged_instance(dtype: str, threads: int, smem: int) -> Instance:
    """The staged forward's instance for a buffer of ``smem`` bytes: the most threads (a power
    of two, at most ``threads`` but never fewer than 128) that leave every thread at least 8
    vectors and a whole number of them in each of its four stages (measured: fewer vectors a thread, and fewer blocks
    an SM, were slower; docs/notes-group-norm.md)."""
    vectors = smem // 16
    t = 1 << (max(128, min(threads, vectors // 8)).bit_length() - 1)
    while t > 128 and vectors % (4 * t):
        t //= 2
    ctype = _arrays.DTYPES[dtype][0]
    return Instance(SOURCE, f"group_norm_fwd_staged<{ctype}, {t}, {smem}>", t, smem=smem)


def _staged_smem(group_bytes: int, device: int) -> int | None:
    """The staged forward's buffer for a group of ``group_bytes``, or None where none fits."""
    room = _kernels.max_shared_memory(device) - _STAGED_SLACK
    return next((s for s in STAGED_SMEM if group_bytes <= s <= room), None)


def instances(configs: Configs = CONFIGS) -> list[Instance]:
    """Every kernel instance the fronts can launch (for the compile check)."""
    out = []
    for dtype, (_, itemsize) in _arrays.DTYPES.items():
        for cl in (False, True):
            for gt in ((1,) + configs.tile_groups if cl else (1,)):
                for vec in sorted({1, 16 // itemsize}):
                    for kind in ("fwd", "bwd"):
                        out.append(configs.get(kind, cl).instance(kind, dtype, cl, gt, vec))
        if configs.fwd_staged:
            out.extend(staged_instance(dtype, configs.fwd_staged, smem) for smem in STAGED_SMEM)
    return out


# ---- argument checks (kernels and references alike) -----------------------------------------

def _check_x(xa: DeviceArray) -> None:
    if xa.ndim < 2:
        raise ValueError(f"{xa.name}: expected (N, C, *spatial) with at least 2 axes, got shape {xa.shape}")


def _check_limits(xa: DeviceArray) -> None:
    """The kernels take N, C and per-channel extents as 32-bit ints."""
    n, c = xa.shape[:2]
    hw = math.prod(xa.shape[2:])
    for what, value in (("N", n), ("C", c), ("the spatial size", hw)):
        if value >= 2**31:
            raise ValueError(f"{xa.name}: {what} = {value} is beyond the kernels' 32-bit range "
                             f"(shape {xa.shape}); split the tensor")


def _check_groups(num_groups, channels: int) -> int:
    g = _checks.index(num_groups, "num_groups")
    if g <= 0:
        raise ValueError(f"num_groups: must be positive, got {g}")
    if channels % g:
        raise ValueError(f"num_groups: {channels} channels cannot be split into {g} equal groups "
                         f"(C = {channels} is not divisible by num_groups = {g})")
    return g


def _check_stats(a: DeviceArray, n: int, g: int) -> None:
    if a.shape not in ((n, g), (n * g,)):
        raise ValueError(f"{a.name}: shape {a.shape} does not match (N, num_groups) = {(n, g)}")


def _check_forward(xa, num_groups, wa, ba, eps) -> tuple[int, float]:
    _check_x(xa)
    c = xa.shape[1]
    g = _check_groups(num_groups, c)
    _checks.like(wa, xa, (c,))
    _checks.like(ba, xa, (c,))
    return g, _checks.eps(eps)


def _check_backward(da, xa, num_groups, wa, ma, sa) -> int:
    _check_x(xa)
    _checks.like(da, xa, xa.shape)
    n, c = xa.shape[:2]
    g = _check_groups(num_groups, c)
    _checks.like(wa, xa, (c,))
    _check_stats(ma, n, g)
    _check_stats(sa, n, g)
    return g


def _optional(obj, name: str):
    return None if obj is None else _arrays.as_device_array(obj, name)


# ---- layouts and geometry -----------------------------------------------------------------------

def _layout(xa: DeviceArray) -> tuple[bool, bool]:
    """(copy needed, channels_last): the input as the kernels can read it, copying only when
    the strides are neither contiguous nor channels-last."""
    if _arrays.is_contiguous(xa):
        return False, False
    if _arrays.is_channels_last(xa):
        return False, True
    return True, False


def _in_layout(channels_last: bool):
    """The fix-up that brings another array into x's layout (a copy only when it differs)."""
    if channels_last:
        return _arrays.channels_last
    return DeviceArray.contiguous


def _geometry(xa: DeviceArray, channels_last: bool, g: int, threads: int, arrays, configs, device: int):
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
        for t in configs.tile_groups:
            if g % t == 0 and t * cg // vec <= 32 and n * g // t >= configs.tiles_per_sm * _kernels.sm_count(device):
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


def _grid(k, cfg: Config, tiles: int, device: int) -> int:
    return max(1, min(tiles, _kernels.sm_count(device) * cfg.per_sm, k.resident_blocks()))


# ---- forward --------------------------------------------------------------------------------

_FWD = PlanCache()


def _forward(x, num_groups, weight, bias, eps, return_stats, configs: Configs):
    arrays = [_arrays.as_device_array(x, "x"), _optional(weight, "weight"), _optional(bias, "bias")]
    key = (num_groups if type(num_groups) is int else None, bool(return_stats), _checks.eps(eps), configs,
           *(a and a.key for a in arrays))
    plan = _FWD.plan(key if key[0] is not None else None, _plan_forward, arrays, num_groups, eps, bool(return_stats),
                     configs)
    bufs = plan(arrays)
    if return_stats:
        return plan.out(bufs, "y"), plan.out(bufs, "mean"), plan.out(bufs, "rstd")
    return plan.out(bufs, "y")


def _plan_forward(arrays, num_groups, eps, return_stats, configs) -> Plan:
    xa, wa, ba = arrays
    g, epsf = _check_forward(xa, num_groups, wa, ba, eps)
    _check_limits(xa)
    device = _arrays.same_device(xa, wa, ba)
    n, c = xa.shape[:2]
    hw = math.prod(xa.shape[2:])
    b = Builder(arrays)
    copy, cl = _layout(xa)
    if copy:
        b.fix(0, DeviceArray.contiguous)
    for i, a in ((1, wa), (2, ba)):
        if a is not None and a.strides != (1,):
            b.fix(i, DeviceArray.contiguous)
    y = b.alloc(xa.shape, xa.dtype, "channels_last" if cl else "contiguous", name="y")
    mean = b.alloc((n, g), "float32", name="mean") if return_stats else None
    rstd = b.alloc((n, g), "float32", name="rstd") if return_stats else None
    groups = n * g
    smem = None
    if groups and c // g * hw and configs.fwd_staged and not cl:
        vec = 16 // xa.itemsize
        if hw % vec == 0 and (copy or xa.ptr % 16 == 0):
            smem = _staged_smem(c // g * hw * xa.itemsize, device)
    if smem is not None:
        k = _kernels.kernel(staged_instance(xa.dtype, configs.fwd_staged, smem), device)
        b.launch(k, min(groups, k.resident_blocks()), x=b.slot(0), w=b.slot(1), b=b.slot(2), y=y, mean_out=mean,
                 rstd_out=rstd, C=c, G=g, HW=hw, groups=groups, eps=epsf)
    elif groups and c // g * hw:
        cfg = configs.get("fwd", cl)
        vec, gt, (seg, seg_len, tcv) = _geometry(xa, cl, g, cfg.threads, (None if copy else xa, wa, ba), configs,
                                                 device)
        k = _kernels.kernel(cfg.instance("fwd", xa.dtype, cl, gt, vec), device)
        tiles = groups // gt
        b.launch(k, _grid(k, cfg, tiles, device), x=b.slot(0), w=b.slot(1), b=b.slot(2), y=y, mean_out=mean,
                 rstd_out=rstd, C=c, G=g, HW=hw, seg=seg, seg_len=seg_len, tcv=tcv, tiles=tiles, eps=epsf)
    elif groups and return_stats:  # empty groups: nothing to normalize
        b.fill(0.0, mean)
        b.fill(float(1.0 / np.sqrt(np.float32(epsf))) if epsf > 0 else float("inf"), rstd)
    return b.plan(device)


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
    return _forward(x, num_groups, weight, bias, eps, return_stats, CONFIGS)


# ---- backward -------------------------------------------------------------------------------

_BWD = PlanCache()


def _backward(dy, x, num_groups, weight, mean, rstd, configs: Configs):
    xa = _arrays.as_device_array(x, "x")
    arrays = [_arrays.as_device_array(dy, "dy"), xa, _optional(weight, "weight"),
              _arrays.as_device_array(mean, "mean", ("float32",)), _arrays.as_device_array(rstd, "rstd", ("float32",))]
    key = (num_groups if type(num_groups) is int else None, configs, *(a and a.key for a in arrays))
    plan = _BWD.plan(key if key[0] is not None else None, _plan_backward, arrays, num_groups, configs)
    bufs = plan(arrays)
    return plan.out(bufs, "dx"), plan.out(bufs, "dweight"), plan.out(bufs, "dbias")


def _plan_backward(arrays, num_groups, configs) -> Plan:
    da, xa, wa, ma, sa = arrays
    g = _check_backward(da, xa, num_groups, wa, ma, sa)
    _check_limits(xa)
    device = _arrays.same_device(xa, da, wa, ma, sa)
    n, c = xa.shape[:2]
    hw = math.prod(xa.shape[2:])
    b = Builder(arrays)
    copy, cl = _layout(xa)
    if copy:
        b.fix(1, DeviceArray.contiguous)
    dy_fixed = not (_arrays.is_channels_last(da) if cl else _arrays.is_contiguous(da))
    if dy_fixed:
        b.fix(0, _in_layout(cl))
    for i, a in ((2, wa), (3, ma), (4, sa)):
        if a is not None and not _arrays.is_contiguous(a):
            b.fix(i, DeviceArray.contiguous)
    dx = b.alloc(xa.shape, xa.dtype, "channels_last" if cl else "contiguous", name="dx")
    dw = b.alloc((c,), xa.dtype, name="dweight") if wa is not None else b.absent("dweight")
    db = b.alloc((c,), xa.dtype, name="dbias")
    groups = n * g
    if not (groups and c // g * hw):
        b.fill(0.0, dw, db)
        return b.plan(device, first=1)
    cfg = configs.get("bwd", cl)
    vec, gt, (seg, seg_len, tcv) = _geometry(xa, cl, g, cfg.threads, (None if copy else xa,
                                                                      None if dy_fixed else da), configs, device)
    k = _kernels.kernel(cfg.instance("bwd", xa.dtype, cl, gt, vec), device)
    tiles = groups // gt
    part = b.alloc((2, n, c), "float32")   # per-sample partial rows of dweight, then of dbias
    dw_part, db_part = part, part + n * c * 4
    b.launch(k, _grid(k, cfg, tiles, device), dy=b.slot(0), x=b.slot(1), w=b.slot(2), mean_in=b.slot(3),
             rstd_in=b.slot(4), dx=dx, dw_part=dw_part, db_part=db_part, C=c, G=g, HW=hw, seg=seg,
             seg_len=seg_len, tcv=tcv, tiles=tiles)
    if dw is not None:
        _partials.sum_rows(b, dw_part, [dw, db], n, c, xa.dtype, device)
    else:
        _partials.sum_rows(b, db_part, [db], n, c, xa.dtype, device)
    return b.plan(device, first=1)


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
    return _backward(dy, x, num_groups, weight, mean, rstd, CONFIGS)


# ---- NumPy references ------------------------------------------------------------------------

def _host(obj, name, dtypes=_arrays.FLOATS):
    """An optional array (weight, bias): None stays None."""
    return None if obj is None else _arrays.as_host_array(obj, name, dtypes)


def _f64(a):
    return None if a is None else a.obj.astype(np.float64)


def _per_channel(p, shape):
    """(C,) -> broadcastable against (N, C, *S)."""
    return _f64(p).reshape((1, shape[1]) + (1,) * (len(shape) - 2))


def reference_group_norm(x, num_groups, weight=None, bias=None, eps=1e-5, *, return_stats=False):
    """``group_norm`` in float64: y, or (y, mean, rstd) with stats (N, num_groups)."""
    xa, wa, ba = _arrays.as_host_array(x, "x"), _host(weight, "weight"), _host(bias, "bias")
    g, e = _check_forward(xa, num_groups, wa, ba, eps)
    shape = xa.shape
    v = _f64(xa).reshape(shape[0], g, -1)
    mean = v.mean(axis=-1) if v.shape[-1] else np.zeros(v.shape[:2])
    var = ((v - mean[..., None]) ** 2).mean(axis=-1) if v.shape[-1] else np.zeros(v.shape[:2])
    rstd = 1.0 / np.sqrt(var + e)
    y = ((v - mean[..., None]) * rstd[..., None]).reshape(shape)
    if wa is not None:
        y = y * _per_channel(wa, shape)
    if ba is not None:
        y = y + _per_channel(ba, shape)
    return (y, mean, rstd) if return_stats else y


def reference_group_norm_backward(dy, x, num_groups, weight, mean, rstd):
    """``group_norm_backward`` in float64: (dx, dweight or None, dbias)."""
    da, xa, wa = _arrays.as_host_array(dy, "dy"), _arrays.as_host_array(x, "x"), _host(weight, "weight")
    ma, sa = _arrays.as_host_array(mean, "mean", ("float32",)), _arrays.as_host_array(rstd, "rstd", ("float32",))
    g = _check_backward(da, xa, num_groups, wa, ma, sa)
    shape = xa.shape
    n = shape[0]
    v = _f64(xa).reshape(n, g, -1)
    mu = _f64(ma).reshape(n, g, 1)
    rs = _f64(sa).reshape(n, g, 1)
    xhat = (v - mu) * rs
    d = _f64(da)
    gg = (d * _per_channel(wa, shape) if wa is not None else d).reshape(v.shape)
    m = max(v.shape[-1], 1)
    dx = rs * (gg - gg.sum(axis=-1, keepdims=True) / m - xhat * (gg * xhat).sum(axis=-1, keepdims=True) / m)
    axes = (0,) + tuple(range(2, len(shape)))
    dw = (d * xhat.reshape(shape)).sum(axis=axes) if wa is not None else None
    return dx.reshape(shape), dw, d.sum(axis=axes)


# ---- benchmark cases ----------------------------------------------------------------------------

# (N, C, H, W) and groups: a diffusion/UNet block.
WORKLOAD = {"full": (16, 512, 64, 64), "quick": (4, 512, 64, 64), "groups": 32, "dtype": "bfloat16"}


def _inputs(shape, dtype, groups, seed, *, channels_last=False, grad=False) -> dict:
    gen = generator(seed)
    x = randn(shape, dtype, gen)
    if channels_last:  # (N, C, *S) stored as (N, *S, C)
        x = x.movedim(1, -1).contiguous().movedim(-1, 1)
    c = shape[1]
    t = {"x": x, "w": randn((c,), dtype, gen), "b": randn((c,), dtype, gen), "g": groups}
    if grad:
        dy = randn(shape, dtype, gen)
        t["dy"] = dy.movedim(1, -1).contiguous().movedim(-1, 1) if channels_last else dy
        t["leaves"] = tuple(a.detach().requires_grad_(True) for a in (t["x"], t["w"], t["b"]))
    return t


def _fwd(t):
    return group_norm(t["x"], t["g"], t["w"], t["b"])


def _torch_fwd(t):
    import torch.nn.functional as F

    return F.group_norm(t["x"], t["g"], t["w"], t["b"])


def _fwd_bwd(t):
    y, mean, rstd = group_norm(t["x"], t["g"], t["w"], t["b"], return_stats=True)
    return (y, *group_norm_backward(t["dy"], t["x"], t["g"], t["w"], mean, rstd))


def _forward_on(F, t):
    if F is None:
        import torch.nn.functional as F
    x, w, b = t["leaves"]
    return F.group_norm(x, t["g"], w, b)


def _torch_fwd_bwd(t):
    import torch

    y = _forward_on(None, t)
    return (y.detach(), *torch.autograd.grad(y, t["leaves"], t["dy"]))


def bench_cases(quick: bool) -> list:
    """Contiguous and channels-last; bytes in passes of the tensor as for the norms: fwd 2,
    fwd+bwd 5."""
    shape, dt, groups = WORKLOAD["quick" if quick else "full"], WORKLOAD["dtype"], WORKLOAD["groups"]
    cases = []
    for cl in (False, True):
        make = functools.partial(_inputs, shape, dt, groups, channels_last=cl)
        tag = " channels_last" if cl else ""
        cases += [
            Case(f"group_norm{tag} fwd", "group_norm", shape, dt, elements_bytes(shape, dt, 2),
                        make, _fwd, _torch_fwd),
            Case(f"group_norm{tag} fwd+bwd", "group_norm", shape, dt, elements_bytes(shape, dt, 5),
                        functools.partial(make, grad=True), _fwd_bwd, _torch_fwd_bwd),
        ]
    return cases


def _liger(t):
    from liger_kernel.ops.group_norm import LigerGroupNormFunction

    x, w, b = t["leaves"]
    return LigerGroupNormFunction.apply(x, w, b, x.shape[1], t["g"], 1e-5)


def torch_bench_cases(quick: bool) -> list:
    shape, dt, groups = WORKLOAD["quick" if quick else "full"], WORKLOAD["dtype"], WORKLOAD["groups"]
    out = []
    for cl in (False, True):
        out.append(TorchCase(f"group_norm{' channels_last' if cl else ''} fwd+bwd", "group_norm", shape, dt,
                                    elements_bytes(shape, dt, 5),
                                    functools.partial(_inputs, shape, dt, groups, channels_last=cl, grad=True),
                                    _forward_on, _fwd_bwd, liger=None if cl else _liger))
    return out


# ---- PyTorch bindings -------------------------------------------------------------------------

def _like_layout(x):
    """An empty tensor in the layout the kernels give x's outputs: contiguous when x is
    (size-1 axes aside), else channels-last (the drop-in hands the op nothing else)."""
    import torch

    if x.is_contiguous() or x.dim() < 3:
        return torch.empty_like(x, memory_format=torch.contiguous_format)
    stored = x.new_empty([x.shape[0], *x.shape[2:], x.shape[1]])
    return stored.permute(0, x.dim() - 1, *range(1, x.dim() - 1))


def _fake(x, num_groups, weight, bias, eps):
    import torch

    stats = x.new_empty((x.shape[0], num_groups), dtype=torch.float32)
    return _like_layout(x), stats, torch.empty_like(stats)


def _bwd_fake(dy, x, num_groups, weight, mean, rstd):
    c = x.shape[1]
    return _like_layout(x), x.new_empty((c,) if weight is not None else (0,)), x.new_empty((c,))


TORCH_OPS = (
    TorchOp("group_norm",
            "(Tensor x, int num_groups, Tensor? weight, Tensor? bias, float eps) -> (Tensor, Tensor, Tensor)",
            forward=lambda x, g, w, b, eps: group_norm(x, g, w, b, eps, return_stats=True),
            inference=lambda x, g, w, b, eps: group_norm(x, g, w, b, eps),
            fake=_fake,
            save=lambda inputs, outputs: ((inputs[0], inputs[2], outputs[1], outputs[2]), inputs[1]),
            backward_schema="(Tensor dy, Tensor x, int num_groups, Tensor? weight, Tensor mean, Tensor rstd) "
                            "-> (Tensor, Tensor, Tensor)",
            backward=group_norm_backward, backward_fake=_bwd_fake,
            backward_args=lambda saved, groups, grads, T: (grads[0], saved[0], groups, *saved[1:]),
            grads_to=(0, 2, 3), native=True),
)


def _route(T, input, num_groups, weight=None, bias=None, eps=1e-5):
    if not input.is_cuda:
        return "not a CUDA tensor"
    dt = T.autocast_dtype("group_norm", input.dtype)
    x, w, b = T.cast(input, dt), T.cast(weight, dt), T.cast(bias, dt)
    reason = T.float_params(x, w, b)
    if reason is None and (x.dim() < 2 or not isinstance(num_groups, int) or num_groups < 1
                           or x.shape[1] % num_groups):
        reason = "shape or num_groups"
    if reason is None and T.small("group_norm", x.numel()):
        reason = T.SMALL
    if reason:
        return reason
    channels_last = x.dim() >= 3 and x.stride(1) == 1 and x.shape[1] > 1 and \
        x.permute(0, *range(2, x.dim()), 1).is_contiguous()
    if not (channels_last or x.is_contiguous()):
        x = x.contiguous()
    return "group_norm", (x, num_groups, w, b, float(eps)), None


FAMILY = Family(
    name="group_norm",
    api=(group_norm, group_norm_backward),
    references={"group_norm": reference_group_norm, "group_norm_backward": reference_group_norm_backward},
    instances=instances,
    bench=bench_cases,
    torch_bench=torch_bench_cases,
    torch_ops=TORCH_OPS,
    dropins=(DropIn("group_norm", _route, compile=True, probe=lambda f, x: f(x, 2), min_size=2**20),),
    modules=(ModuleSpec("GroupNorm", "GroupNorm", "group_norm",
                        lambda m, x: (x, m.num_groups, m.weight, m.bias, m.eps)),),
)
