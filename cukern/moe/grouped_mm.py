"""Grouped matrix products over expert groups on tensor cores (cuda_src/moe_grouped_mm.cu):
the expert layers' forward product and both of its backward products, with the groups' sizes
read on the device (``moe_permute``'s offsets): no host synchronization.

Shapes: rows ``a`` (R, K); weights ``b`` (E, N, K) as nn.Linear's (an expert's output
features by its input features), or (E, K, N) with ``b_layout="kn"`` (the same kernels, the
weight read the other way: the forward takes d a's kernel and d a the forward's); offsets
(E + 1,) int32, expert e's rows offsets[e]:offsets[e + 1]; float16 or bfloat16 (float32
accumulation, one rounding); K and N multiples of 8.

On Hopper (sm_90), the three products take cuda_src/moe_grouped_mm_sm90.cu (TMA and wgmma) where
the output's columns are a multiple of 64 (N for the forward, K for d a and d b), the rows at
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
LAYOUTS = ("nk", "kn")   # b (E, N, K) as nn.Linear's, or (E, K, N)
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
    if SM80_ONLY or rows < BM or k < 64 or -(-n_out // 128) * row_tiles >= 2**31:
        return None
    if _kernels.compute_capability(device) != (9, 0):
        return None
    # (128-column tiles also where 128 does not divide the columns: the last tile partial)
    return 256 if n_out % 256 == 0 else 128 if n_out % 64 == 0 else None


def _fault(device: int):
    return _arrays.wrap(_faults.record(device), "fault record")


def _check(aa: DeviceArray, ba: DeviceArray, oa: DeviceArray, b_layout: str,
           a_name: str = "a") -> tuple[int, int, int, int]:
    """(rows, k, experts, n) of a grouped product's operands (b (E, N, K) for "nk", (E, K, N)
    for "kn"), or a ValueError naming the argument."""
    if b_layout not in LAYOUTS:
        raise ValueError(f"b_layout: expected one of {LAYOUTS}, got {b_layout!r}")
    if aa.dtype not in DTYPES:
        raise ValueError(f"{a_name}: dtype {aa.dtype}; the grouped products take float16 or bfloat16")
    if aa.ndim != 2 or not (0 in aa.shape or _arrays.is_contiguous(aa)):
        raise ValueError(f"{a_name}: expected contiguous (rows, features), got shape {aa.shape}")
    dims = "out_features, in_features" if b_layout == "nk" else "in_features, out_features"
    if ba.ndim != 3 or not (0 in ba.shape or _arrays.is_contiguous(ba)):
        raise ValueError(f"b: expected contiguous (experts, {dims}), got shape {ba.shape}")
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
    k, n = (ba.shape[2], ba.shape[1]) if b_layout == "nk" else (ba.shape[1], ba.shape[2])
    if k != aa.shape[1]:
        raise ValueError(f"b: shape {ba.shape} ({dims}); its in_features must be {a_name}'s {aa.shape[1]}")
    _multiple_of_8(a_name, "in_features", k)
    _multiple_of_8("b", "out_features", n)
    return rows, k, experts, n


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


def _row_tiles(rows: int, experts: int) -> int:
    return -(-rows // BM) + experts + 1   # (an upper bound of the groups' row tiles)


def _rows_by_bt(b: Builder, a: int, w: int, out, dtype: str, offsets: int, rows: int, n: int, k: int,
                experts: int, device: int) -> None:
    """out (rows, n) = a (rows, k) . w[e] (n, k)^T over each expert e's rows (slots a, w and
    offsets; w's k contiguous): the forward kernel."""
    m_tiles = _row_tiles(rows, experts)
    bn = _sm90_tile(device, rows, n, k, m_tiles) if rows and n else None
    if bn is not None:
        kern = _kernels.kernel(_sm90_instance("forward", dtype, bn), device)
        b.launch(kern, (-(-n // bn) * m_tiles,), a_map=MapSlot(a, (BM, 64)), b_map=MapSlot(w, (1, bn, 64)), c=out,
                 offsets=b.slot(offsets), m_size=rows, n_size=n, k_size=k, experts=experts, m_tiles=m_tiles,
                 ldc=n, c_expert_stride=0, fault=_fault(device))
    elif rows and n:
        kern = _kernels.kernel(_instance("forward", dtype), device)
        b.launch(kern, (m_tiles, -(-n // BN)), a=b.slot(a), b=b.slot(w), c=out, offsets=b.slot(offsets),
                 m_size=rows, n_size=n, k_size=k, experts=experts, lda=k, ldb=k, ldc=n, b_expert_stride=n * k,
                 c_expert_stride=0, fault=_fault(device))


def _rows_by_b(b: Builder, a: int, w: int, out, dtype: str, offsets: int, rows: int, n: int, k: int,
               experts: int, device: int) -> None:
    """out (rows, n) = a (rows, k) . w[e] (k, n) over each expert e's rows (w's n contiguous:
    read MN-major on Hopper): the d a kernel."""
    m_tiles = _row_tiles(rows, experts)
    bn = _sm90_tile(device, rows, n, k, m_tiles) if rows and n else None
    if bn is not None:
        kern = _kernels.kernel(_sm90_instance("da", dtype, bn), device)
        b.launch(kern, (-(-n // bn) * m_tiles,), a_map=MapSlot(a, (BM, 64)), b_map=MapSlot(w, (1, 64, 64)), c=out,
                 offsets=b.slot(offsets), m_size=rows, n_size=n, k_size=k, experts=experts, m_tiles=m_tiles,
                 ldc=n, c_expert_stride=0, fault=_fault(device))
    elif rows and n:
        # B(n', k') = w[e][k' * n + n']
        kern = _kernels.kernel(_instance("da", dtype), device)
        b.launch(kern, (m_tiles, -(-n // BN)), a=b.slot(a), b=b.slot(w), c=out, offsets=b.slot(offsets),
                 m_size=rows, n_size=n, k_size=k, experts=experts, lda=k, ldb=n, ldc=n, b_expert_stride=n * k,
                 c_expert_stride=0, fault=_fault(device))


def _groups_lt_r(b: Builder, left: int, right: int, out, dtype: str, offsets: int, rows: int, m: int, n: int,
                 experts: int, device: int) -> None:
    """out[e] (m, n) = left[rows of e]^T . right[rows of e], left (rows, m) and right (rows,
    n): the d b kernel, its sum over each expert's rows (both read MN-major on Hopper); an
    expert without rows gets zeros."""
    bn = _sm90_tile(device, rows, n, m, -(-m // BM)) if m and n else None
    if bn is not None:
        kern = _kernels.kernel(_sm90_instance("db", dtype, bn), device)
        b.launch(kern, (-(-m // BM) * -(-n // bn), experts), a_map=MapSlot(left, (64, 64)),
                 b_map=MapSlot(right, (64, 64)), c=out, offsets=b.slot(offsets), m_size=m, n_size=n, k_size=rows,
                 experts=experts, m_tiles=0, ldc=n, c_expert_stride=m * n, fault=_fault(device))
    elif m and n:
        # A(m', r) = left[r * m + m'], B(n', r) = right[r * n + n']
        kern = _kernels.kernel(_instance("db", dtype), device)
        b.launch(kern, (-(-m // BM) * -(-n // BN), experts), a=b.slot(left), b=b.slot(right), c=out,
                 offsets=b.slot(offsets), m_size=m, n_size=n, k_size=rows, experts=experts, lda=m, ldb=n, ldc=n,
                 b_expert_stride=0, c_expert_stride=m * n, fault=_fault(device))


def moe_grouped_mm(a, b, offsets, *, b_layout: str = "nk"):
    """Each expert's rows times its weight, as ``cukern.moe.reference.grouped_matmul``.

    Args:
        a: (R, K) float16 or bfloat16, contiguous: the rows grouped by expert (``moe_permute``'s
            x_perm, or the activation between the two products).
        b: a's dtype, contiguous: each expert's weight, (E, N, K) as nn.Linear's (``b_layout``
            "nk": ``a @ b[e].T``), or (E, K, N) ("kn": ``a @ b[e]``, as torch._grouped_mm and
            GPT-OSS's experts hold it).
        offsets: (E + 1,) int32: expert e's rows are offsets[e]:offsets[e + 1] (``moe_permute``'s);
            rows after offsets[E] get zeros. Offsets out of order are a fault
            (``cukern.check_errors()``), never an access outside the arrays.
        b_layout: "nk" or "kn".

    Returns:
        (R, N) in a's dtype, float32 sums rounded once. K and N must be multiples of 8.
    """
    arrays = [_arrays.as_device_array(a, "a"), _arrays.as_device_array(b, "b"),
              _arrays.as_device_array(offsets, "offsets", INT)]
    plan = _FORWARD.plan((SM80_ONLY, b_layout, *(x.key for x in arrays)), _plan_forward, arrays, b_layout)
    return plan.out(plan(arrays), "out")


def _plan_forward(arrays, b_layout: str) -> Plan:
    aa, ba, oa = arrays
    rows, k, experts, n = _check(aa, ba, oa, b_layout)
    device = _arrays.same_device(*arrays)
    b = Builder(arrays)
    _aligned(b, ((0, aa), (1, ba)))
    out = b.alloc((rows, n), aa.dtype, name="out")
    (_rows_by_bt if b_layout == "nk" else _rows_by_b)(b, 0, 1, out, aa.dtype, 2, rows, n, k, experts, device)
    return b.plan(device)


def moe_grouped_mm_backward(dout, a, b, offsets, *, b_layout: str = "nk"):
    """Gradients of ``moe_grouped_mm``: ``(da (R, K), db)`` in a's dtype, db of b's shape.

    "nk": ``da[rows of e] = dout[rows of e] @ b[e]`` and ``db[e] = dout[rows of e]^T @ a[rows
    of e]``; "kn": ``da[rows of e] = dout[rows of e] @ b[e].T`` and ``db[e] = a[rows of e]^T @
    dout[rows of e]``. float32 sums rounded once; an expert without rows gets a zero ``db[e]``,
    rows after offsets[E] a zero ``da``. dout (R, N) contiguous, a's dtype."""
    arrays = [_arrays.as_device_array(dout, "dout"), _arrays.as_device_array(a, "a"),
              _arrays.as_device_array(b, "b"), _arrays.as_device_array(offsets, "offsets", INT)]
    plan = _BACKWARD.plan((SM80_ONLY, b_layout, *(x.key for x in arrays)), _plan_backward, arrays, b_layout)
    bufs = plan(arrays)
    return plan.out(bufs, "da"), plan.out(bufs, "db")


def _plan_backward(arrays, b_layout: str) -> Plan:
    da_, aa, ba, oa = arrays
    rows, k, experts, n = _check(aa, ba, oa, b_layout)
    if da_.shape != (rows, n) or da_.dtype != aa.dtype or not (0 in da_.shape or _arrays.is_contiguous(da_)):
        raise ValueError(f"dout: shape {da_.shape} {da_.dtype}; expected contiguous {(rows, n)} {aa.dtype}")
    device = _arrays.same_device(*arrays)
    b = Builder(arrays)
    _aligned(b, ((0, da_), (1, aa), (2, ba)))
    da = b.alloc((rows, k), aa.dtype, name="da")
    db = b.alloc(ba.shape, aa.dtype, name="db")
    if b_layout == "nk":
        _rows_by_b(b, 0, 2, da, aa.dtype, 3, rows, k, n, experts, device)       # da = dout . b[e], b[e] (n, k)
        _groups_lt_r(b, 0, 1, db, aa.dtype, 3, rows, n, k, experts, device)     # db[e] (n, k) = dout^T . a
    else:
        _rows_by_bt(b, 0, 2, da, aa.dtype, 3, rows, k, n, experts, device)      # da = dout . b[e]^T, b[e] (k, n)
        _groups_lt_r(b, 1, 0, db, aa.dtype, 3, rows, k, n, experts, device)     # db[e] (k, n) = a^T . dout
    return b.plan(device)
