"""Grouped matrix products over expert groups on tensor cores (cuda_src/moe_grouped_mm.cu):
the expert layers' forward product and both of its backward products, with the groups' sizes
read on the device (``moe_permute``'s offsets): no host synchronization.

Shapes: rows ``a`` (R, K); weights ``b`` (E, N, K) as nn.Linear's (an expert's output
features by its input features); offsets (E + 1,) int32, expert e's rows offsets[e]:offsets[e +
1]; float16 or bfloat16 (float32 accumulation, one rounding); K and N multiples of 8.

On Hopper (sm_90), the three products take cuda_src/moe_grouped_mm_sm90.cu (TMA and wgmma) where
the output's columns are a multiple of 128 (N for the forward, K for d a and d b), the rows at
least 128 and the inner size at least 64 (K for the forward, N for d a and d b); the rest take the
mma.sync kernels. ``CUKERN_MOE_SM80=1`` (read at import) keeps Hopper
on the mma.sync kernels too."""
from __future__ import annotations

import os

from .. import _arrays, _faults, _kernels
from .._arrays import DeviceArray
from .._kernels import Instance, MapSlot
from .._plans import Builder, Plan, PlanCache

SOURCE = "moe_grouped_mm.cu"
SM90_SOURCE = "moe_grouped_mm_sm90.cu"
THREADS = 256
BM = BN = 128                 # cuda_src/moe_grouped_mm.cu's tile
SM90_THREADS = 384            # two consumer warpgroups and a producer
SM90_STAGES = {256: 4, 128: 6}   # BN -> ring stages of 128 x 64 rows of a and BN x 64 of b
DTYPES = ("float16", "bfloat16")
INT = ("int32",)
# (A's k contiguous, B's k contiguous, groups of k): the forward, d a, d b
PRODUCTS = {"forward": (True, True, False), "da": (True, False, False), "db": (False, False, True)}
SM80_ONLY = os.environ.get("CUKERN_MOE_SM80", "0") not in ("", "0")


def _instance(product: str, dtype: str) -> Instance:
    a_kc, b_kc, group_k = (str(v).lower() for v in PRODUCTS[product])
    return Instance(SOURCE, f"moe_grouped_mm<{_arrays.DTYPES[dtype][0]}, {a_kc}, {b_kc}, {group_k}>", THREADS)


def _sm90_instance(product: str, dtype: str, bn: int) -> Instance:
    stages = SM90_STAGES[bn]
    smem = stages * (BM * 64 * 2 + bn * 64 * 2) + 1024   # the ring, and slack to align it to 1024 bytes
    return Instance(SM90_SOURCE, f"moe_grouped_mm_sm90<{_arrays.DTYPES[dtype][0]}, {list(PRODUCTS).index(product)}, "
                                 f"{bn}, {stages}, {smem}>", SM90_THREADS, smem, "sm_90a")


def instances() -> list[Instance]:
    """Every kernel instance the functions here can launch (for the compile check)."""
    return ([_instance(p, d) for p in PRODUCTS for d in DTYPES]
            + [_sm90_instance(p, d, bn) for p in PRODUCTS for d in DTYPES for bn in SM90_STAGES])


def _sm90_tile(device: int, rows: int, n_out: int, k: int, row_tiles: int) -> int | None:
    """The Hopper kernel's column tile for a product with ``n_out`` output columns and inner
    size ``k`` (groups of rows; for d b, ``k`` is the output's rows: its sum runs over the rows),
    or None where the mma.sync kernel runs. ``row_tiles``: the grid's row tiles, which times
    the column tiles must stay below 2^31 (the Hopper grid is 1-D)."""
    if SM80_ONLY or rows < BM or k < 64 or n_out // 128 * row_tiles >= 2**31:
        return None
    if _kernels.compute_capability(device) != (9, 0):
        return None
    return 256 if n_out % 256 == 0 else 128 if n_out % 128 == 0 else None


def _fault(device: int):
    return _arrays.wrap(_faults.record(device), "fault record")


def _check(aa: DeviceArray, ba: DeviceArray, oa: DeviceArray, a_name: str = "a") -> tuple[int, int, int, int]:
    """(rows, k, experts, n) of a grouped product's operands, or a ValueError naming the argument."""
    if aa.dtype not in DTYPES:
        raise ValueError(f"{a_name}: dtype {aa.dtype}; the grouped products take float16 or bfloat16")
    if aa.ndim != 2 or not (0 in aa.shape or _arrays.is_contiguous(aa)):
        raise ValueError(f"{a_name}: expected contiguous (rows, features), got shape {aa.shape}")
    if ba.ndim != 3 or not (0 in ba.shape or _arrays.is_contiguous(ba)):
        raise ValueError(f"b: expected contiguous (experts, out_features, in_features), got shape {ba.shape}")
    if ba.dtype != aa.dtype:
        raise ValueError(f"b: dtype {ba.dtype}, expected {a_name}'s {aa.dtype}")
    experts = ba.shape[0]
    if experts < 1:
        raise ValueError("b: no experts (shape (0, ...))")
    if oa.shape != (experts + 1,) or not _arrays.is_contiguous(oa):
        raise ValueError(f"offsets: shape {oa.shape}; expected contiguous ({experts + 1},), one more than b's experts")
    if experts > 65535:
        raise ValueError(f"b: {experts} experts; at most 65535")
    rows = aa.shape[0]
    if rows > 2**31 - 1 - BM:
        raise ValueError(f"{a_name}: {rows} rows; at most 2^31 - {BM + 1}")
    return rows, aa.shape[1], experts, ba.shape[1]


def _aligned(b: Builder, slots) -> None:
    """cp.async moves 16-byte chunks: an operand at an address that is not 16-byte aligned (a
    view at an odd element offset) is read from a fresh copy."""
    for i, a in slots:
        if a.ptr % 16:
            b.fix(i, DeviceArray.copy)


def _multiple_of_8(name: str, what: str, v: int) -> None:
    if v % 8:
        raise ValueError(f"{name}: {what} {v} is not a multiple of 8 (the products move 16-byte vectors)")


_FORWARD = PlanCache()
_BACKWARD = PlanCache()


def moe_grouped_mm(a, b, offsets):
    """Each expert's rows times its weight transposed, as ``cukern.moe.reference.grouped_matmul``.

    Args:
        a: (R, K) float16 or bfloat16, contiguous: the rows grouped by expert (``moe_permute``'s
            x_perm, or the activation between the two products).
        b: (E, N, K), a's dtype, contiguous: each expert's weight as nn.Linear's.
        offsets: (E + 1,) int32: expert e's rows are offsets[e]:offsets[e + 1] (``moe_permute``'s);
            rows after offsets[E] get zeros. Offsets out of order are a fault
            (``cukern.check_errors()``), never an access outside the arrays.

    Returns:
        (R, N) in a's dtype, float32 sums rounded once. K and N must be multiples of 8.
    """
    arrays = [_arrays.as_device_array(a, "a"), _arrays.as_device_array(b, "b"),
              _arrays.as_device_array(offsets, "offsets", INT)]
    plan = _FORWARD.plan((SM80_ONLY, *(x.key for x in arrays)), _plan_forward, arrays)
    return plan.out(plan(arrays), "out")


def _plan_forward(arrays) -> Plan:
    aa, ba, oa = arrays
    rows, k, experts, n = _check(aa, ba, oa)
    if ba.shape[2] != k:
        raise ValueError(f"b: shape {ba.shape}; its in_features must be a's {k}")
    _multiple_of_8("a", "in_features", k)
    _multiple_of_8("b", "out_features", n)
    device = _arrays.same_device(*arrays)
    b = Builder(arrays)
    _aligned(b, ((0, aa), (1, ba)))
    out = b.alloc((rows, n), aa.dtype, name="out")
    m_tiles = -(-rows // BM) + experts + 1   # (an upper bound of the groups' row tiles)
    bn = _sm90_tile(device, rows, n, k, m_tiles) if rows and n else None
    if bn is not None:
        kern = _kernels.kernel(_sm90_instance("forward", aa.dtype, bn), device)
        b.launch(kern, (n // bn * m_tiles,), a_map=MapSlot(0, (BM, 64)), b_map=MapSlot(1, (1, bn, 64)), c=out,
                 offsets=b.slot(2), m_size=rows, n_size=n, k_size=k, experts=experts, m_tiles=m_tiles, ldc=n,
                 c_expert_stride=0, fault=_fault(device))
    elif rows and n:
        kern = _kernels.kernel(_instance("forward", aa.dtype), device)
        b.launch(kern, (m_tiles, -(-n // BN)), a=b.slot(0), b=b.slot(1), c=out,
                 offsets=b.slot(2), m_size=rows, n_size=n, k_size=k, experts=experts, lda=k, ldb=k, ldc=n,
                 b_expert_stride=n * k, c_expert_stride=0, fault=_fault(device))
    return b.plan(device)


def moe_grouped_mm_backward(dout, a, b, offsets):
    """Gradients of ``moe_grouped_mm``: ``(da (R, K), db (E, N, K))`` in a's dtype.

    ``da[rows of e] = dout[rows of e] @ b[e]`` and ``db[e] = dout[rows of e]^T @ a[rows of e]``,
    float32 sums rounded once; an expert without rows gets a zero ``db[e]``, rows after
    offsets[E] a zero ``da``. dout (R, N) contiguous, a's dtype."""
    arrays = [_arrays.as_device_array(dout, "dout"), _arrays.as_device_array(a, "a"),
              _arrays.as_device_array(b, "b"), _arrays.as_device_array(offsets, "offsets", INT)]
    plan = _BACKWARD.plan((SM80_ONLY, *(x.key for x in arrays)), _plan_backward, arrays)
    bufs = plan(arrays)
    return plan.out(bufs, "da"), plan.out(bufs, "db")


def _plan_backward(arrays) -> Plan:
    da_, aa, ba, oa = arrays
    rows, k, experts, n = _check(aa, ba, oa)
    if ba.shape[2] != k:
        raise ValueError(f"b: shape {ba.shape}; its in_features must be a's {k}")
    if da_.shape != (rows, n) or da_.dtype != aa.dtype or not (0 in da_.shape or _arrays.is_contiguous(da_)):
        raise ValueError(f"dout: shape {da_.shape} {da_.dtype}; expected contiguous {(rows, n)} {aa.dtype}")
    _multiple_of_8("a", "in_features", k)
    _multiple_of_8("b", "out_features", n)
    device = _arrays.same_device(*arrays)
    b = Builder(arrays)
    _aligned(b, ((0, da_), (1, aa), (2, ba)))
    da = b.alloc((rows, k), aa.dtype, name="da")
    db = b.alloc((experts, n, k), aa.dtype, name="db")
    fault = _fault(device)
    m_tiles = -(-rows // BM) + experts + 1   # (an upper bound of the groups' row tiles)
    bn = _sm90_tile(device, rows, k, n, m_tiles) if rows and k else None
    if bn is not None:
        # da (rows, k) = dout (rows, n) . b[e] (n, k), b[e] read MN-major in boxes of 64 x 64
        kern = _kernels.kernel(_sm90_instance("da", aa.dtype, bn), device)
        b.launch(kern, (k // bn * m_tiles,), a_map=MapSlot(0, (BM, 64)), b_map=MapSlot(2, (1, 64, 64)), c=da,
                 offsets=b.slot(3), m_size=rows, n_size=k, k_size=n, experts=experts, m_tiles=m_tiles, ldc=k,
                 c_expert_stride=0, fault=fault)
    elif rows and k:
        # da (rows, k) = dout (rows, n) . b[e] (n, k): B(n', k') = b[e][k' * k + n'], groups of rows
        kern = _kernels.kernel(_instance("da", aa.dtype), device)
        b.launch(kern, (m_tiles, -(-k // BN)), a=b.slot(0), b=b.slot(2), c=da,
                 offsets=b.slot(3), m_size=rows, n_size=k, k_size=n, experts=experts, lda=n, ldb=k, ldc=k,
                 b_expert_stride=n * k, c_expert_stride=0, fault=fault)
    bn = _sm90_tile(device, rows, k, n, -(-n // BM)) if n and k else None
    if bn is not None:
        # db[e] (n, k) = dout^T . a over e's rows, both read MN-major in boxes of 64 rows x 64
        kern = _kernels.kernel(_sm90_instance("db", aa.dtype, bn), device)
        b.launch(kern, (-(-n // BM) * (k // bn), experts), a_map=MapSlot(0, (64, 64)), b_map=MapSlot(1, (64, 64)),
                 c=db, offsets=b.slot(3), m_size=n, n_size=k, k_size=rows, experts=experts, m_tiles=0, ldc=k,
                 c_expert_stride=n * k, fault=fault)
    elif n and k:
        # db[e] (n, k) = dout^T . a over e's rows: A(m, r) = dout[r * n + m], B(k', r) = a[r * k + k']
        kern = _kernels.kernel(_instance("db", aa.dtype), device)
        b.launch(kern, (-(-n // BM) * -(-k // BN), experts), a=b.slot(0), b=b.slot(1), c=db, offsets=b.slot(3),
                 m_size=n, n_size=k, k_size=rows, experts=experts, lda=n, ldb=k, ldc=k, b_expert_stride=0,
                 c_expert_stride=n * k, fault=fault)
    return b.plan(device)
