"""Biased experts with a clamped gate (GPT-OSS's) around the grouped products
(cuda_src/moe_biased_glu.cu): the gate with the up projection's bias, its backward, a bias added
to each expert's rows, and each expert's rows summed (the biases' gradients). Rows are grouped
by expert as the grouped products take them (``offsets`` (E + 1,) int32, on the device); the
rows after offsets[E] get no bias and no sum.

Shapes: h (R, 2I) float16 or bfloat16, the gate's and the up projection's columns interleaved
(g0, u0, g1, u1, ...); z and dz (R, I); biases (E, 2I) or (E, N), float32 or h's dtype; I and N
multiples of 8 (as the products need). Every value is computed in float32 and rounded once."""
from __future__ import annotations

from .. import _arrays, _kernels
from .._arrays import DeviceArray
from .._kernels import Instance
from .._plans import Builder, Plan, PlanCache
from .grouped_mm import _aligned   # (16-byte vectors: a misaligned operand read from a copy)

SOURCE = "moe_biased_glu.cu"
THREADS = 256
DTYPES = ("float16", "bfloat16")
INT = ("int32",)


def _instance(kind: str, dtype: str, bias: str | None = None) -> Instance:
    t = _arrays.DTYPES[dtype][0]
    if kind == "sums":
        return Instance(SOURCE, f"moe_group_sums<{t}, {THREADS}>", THREADS)
    return Instance(SOURCE, f"{kind}<{t}, {_arrays.DTYPES[bias][0]}, {THREADS}>", THREADS)


def instances() -> list[Instance]:
    """Every kernel instance the functions here can launch (for the compile check)."""
    return ([_instance(k, d, b) for k in ("moe_biased_glu", "moe_biased_glu_bwd", "moe_group_bias")
             for d in DTYPES for b in ("float32", d)] + [_instance("sums", d) for d in DTYPES])


def _rows(a: DeviceArray, cols_name: str, mult: int) -> tuple[int, int]:
    if a.dtype not in DTYPES:
        raise ValueError(f"{a.name}: dtype {a.dtype}; expected float16 or bfloat16")
    if a.ndim != 2 or not (0 in a.shape or _arrays.is_contiguous(a)):
        raise ValueError(f"{a.name}: expected contiguous (rows, {cols_name}), got shape {a.shape}")
    if a.shape[1] % mult:
        raise ValueError(f"{a.name}: {a.shape[1]} columns, not a multiple of {mult}")
    return a.shape


def _bias(ba: DeviceArray, oa: DeviceArray, cols: int, dtype: str) -> int:
    """The experts E, or a ValueError naming the argument."""
    if ba.dtype not in ("float32", dtype):
        raise ValueError(f"bias: dtype {ba.dtype}; expected float32 or {dtype}")
    if ba.ndim != 2 or ba.shape[1] != cols or ba.shape[0] < 1 or not _arrays.is_contiguous(ba):
        raise ValueError(f"bias: shape {ba.shape}; expected contiguous (experts, {cols})")
    if oa.shape != (ba.shape[0] + 1,) or not _arrays.is_contiguous(oa):
        raise ValueError(f"offsets: shape {oa.shape}; expected contiguous ({ba.shape[0] + 1},), one more than the "
                         "bias's experts")
    if ba.shape[0] > 65535:
        raise ValueError(f"bias: {ba.shape[0]} experts; at most 65535")
    return ba.shape[0]


def _scalars(alpha, limit) -> tuple[float, float]:
    for name, v in (("alpha", alpha), ("limit", limit)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v == float("inf"):
            raise ValueError(f"{name}: must be a positive finite number, got {v!r}")
    return float(alpha), float(limit)


_GLU = PlanCache()
_GLU_BWD = PlanCache()
_BIAS = PlanCache()
_SUMS = PlanCache()


def moe_biased_glu(h, bias, offsets, alpha: float, limit: float):
    """GPT-OSS's gate: ``z = (u + 1) * g * sigmoid(alpha * g)``, ``g = min(h[:, 0::2] + b, limit)``,
    ``u = clamp(h[:, 1::2] + b, -limit, limit)``, b the row's expert's bias.

    Args:
        h: (R, 2I) float16 or bfloat16: the up projection's output before its bias, gate and up
            columns interleaved. bias: (E, 2I) float32 or h's dtype. offsets: (E + 1,) int32.
        alpha, limit: positive.

    Returns:
        z (R, I) in h's dtype.
    """
    arrays = [_arrays.as_device_array(h, "h"), _arrays.as_device_array(bias, "bias"),
              _arrays.as_device_array(offsets, "offsets", INT)]
    alpha, limit = _scalars(alpha, limit)
    plan = _GLU.plan((alpha, limit, *(a.key for a in arrays)), _plan_glu, arrays, alpha, limit)
    return plan.out(plan(arrays), "z")


def _plan_glu(arrays, alpha: float, limit: float) -> Plan:
    ha, ba, oa = arrays
    rows, two_i = _rows(ha, "2 * intermediate", 16)
    experts = _bias(ba, oa, two_i, ha.dtype)
    device = _arrays.same_device(*arrays)
    b = Builder(arrays)
    _aligned(b, enumerate(arrays[:2]))
    z = b.alloc((rows, two_i // 2), ha.dtype, name="z")
    if rows and two_i:
        kern = _kernels.kernel(_instance("moe_biased_glu", ha.dtype, ba.dtype), device)
        b.launch(kern, -(-rows // (THREADS // 32)), h=b.slot(0), bias=b.slot(1), offsets=b.slot(2), z=z, rows=rows,
                 inter=two_i // 2, experts=experts, alpha=alpha, limit=limit)
    return b.plan(device)


def moe_biased_glu_backward(dz, h, bias, offsets, alpha: float, limit: float):
    """Gradients of ``moe_biased_glu``: ``(dh (R, 2I) in h's dtype, dbias (E, 2I) float32)``;
    dbias sums each expert's rows of dh as rounded (the same bits every call)."""
    arrays = [_arrays.as_device_array(dz, "dz"), _arrays.as_device_array(h, "h"), _arrays.as_device_array(bias, "bias"),
              _arrays.as_device_array(offsets, "offsets", INT)]
    alpha, limit = _scalars(alpha, limit)
    plan = _GLU_BWD.plan((alpha, limit, *(a.key for a in arrays)), _plan_glu_backward, arrays, alpha, limit)
    bufs = plan(arrays)
    return plan.out(bufs, "dh"), plan.out(bufs, "dbias")


def _plan_glu_backward(arrays, alpha: float, limit: float) -> Plan:
    da, ha, ba, oa = arrays
    rows, two_i = _rows(ha, "2 * intermediate", 16)
    if da.shape != (rows, two_i // 2) or da.dtype != ha.dtype or not (0 in da.shape or _arrays.is_contiguous(da)):
        raise ValueError(f"dz: shape {da.shape} {da.dtype}; expected contiguous {(rows, two_i // 2)} {ha.dtype}")
    experts = _bias(ba, oa, two_i, ha.dtype)
    device = _arrays.same_device(*arrays)
    b = Builder(arrays)
    _aligned(b, enumerate(arrays[:3]))
    dh = b.alloc((rows, two_i), ha.dtype, name="dh")
    dbias = b.alloc((experts, two_i), "float32", name="dbias")
    if rows and two_i:
        kern = _kernels.kernel(_instance("moe_biased_glu_bwd", ha.dtype, ba.dtype), device)
        b.launch(kern, -(-rows // (THREADS // 32)), dz=b.slot(0), h=b.slot(1), bias=b.slot(2), offsets=b.slot(3),
                 dh=dh, rows=rows, inter=two_i // 2, experts=experts, alpha=alpha, limit=limit)
    _launch_sums(b, dh, 3, rows, two_i, experts, ha.dtype, dbias, device)
    return b.plan(device)


def moe_group_bias(y, bias, offsets):
    """``y + bias[e]`` on expert e's rows (the rows after offsets[E] as they are): y (R, N)
    float16 or bfloat16, bias (E, N) float32 or y's dtype; (R, N) in y's dtype, rounded once."""
    arrays = [_arrays.as_device_array(y, "y"), _arrays.as_device_array(bias, "bias"),
              _arrays.as_device_array(offsets, "offsets", INT)]
    plan = _BIAS.plan(tuple(a.key for a in arrays), _plan_bias, arrays)
    return plan.out(plan(arrays), "out")


def _plan_bias(arrays) -> Plan:
    ya, ba, oa = arrays
    rows, cols = _rows(ya, "features", 8)
    experts = _bias(ba, oa, cols, ya.dtype)
    device = _arrays.same_device(*arrays)
    b = Builder(arrays)
    _aligned(b, enumerate(arrays[:2]))
    out = b.alloc((rows, cols), ya.dtype, name="out")
    if rows and cols:
        kern = _kernels.kernel(_instance("moe_group_bias", ya.dtype, ba.dtype), device)
        b.launch(kern, -(-rows // (THREADS // 32)), y=b.slot(0), bias=b.slot(1), offsets=b.slot(2), out=out,
                 rows=rows, cols=cols, experts=experts)
    return b.plan(device)


def moe_group_sums(x, offsets, experts: int):
    """(E, N) float32: expert e's rows of x (R, N) (float16 or bfloat16) summed in float32, in a
    fixed order; zeros for an expert without rows (the rows after offsets[E] are not summed)."""
    arrays = [_arrays.as_device_array(x, "x"), _arrays.as_device_array(offsets, "offsets", INT)]
    if isinstance(experts, bool) or not isinstance(experts, int) or not 1 <= experts <= 65535:
        raise ValueError(f"experts: must be an int in [1, 65535], got {experts!r}")
    plan = _SUMS.plan((experts, *(a.key for a in arrays)), _plan_sums, arrays, experts)
    return plan.out(plan(arrays), "sums")


def _plan_sums(arrays, experts: int) -> Plan:
    xa, oa = arrays
    rows, cols = _rows(xa, "features", 8)
    if oa.shape != (experts + 1,) or not _arrays.is_contiguous(oa):
        raise ValueError(f"offsets: shape {oa.shape}; expected contiguous ({experts + 1},)")
    device = _arrays.same_device(*arrays)
    b = Builder(arrays)
    _aligned(b, enumerate(arrays[:1]))
    sums = b.alloc((experts, cols), "float32", name="sums")
    _launch_sums(b, b.slot(0), 1, rows, cols, experts, xa.dtype, sums, device)
    return b.plan(device)


def _launch_sums(b: Builder, x, offsets: int, rows: int, cols: int, experts: int, dtype: str, out, device) -> None:
    if cols:
        kern = _kernels.kernel(_instance("sums", dtype), device)
        b.launch(kern, (-(-cols // 256), experts), x=x, offsets=b.slot(offsets), out=out, rows=rows, cols=cols,
                 experts=experts)
