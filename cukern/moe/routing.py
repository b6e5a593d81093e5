"""The router and the token permutation on the kernels (cuda_src/moe.cu): array functions with
their launch plans, forward and backward. No call reads a count on the host: the expert
counts, offsets and rows stay on the device (a CUDA graph may capture them).

Shapes: logits (T, E) float32/float16/bfloat16, E <= 256; weights (T, k) float32; experts
(T, k) int32; x (T, H) and the permuted rows (T k, H) of one float dtype, H a multiple of
nothing in particular (rows are copied by the widest vector that divides them)."""
from __future__ import annotations

import math

from .. import _arrays, _checks, _faults, _kernels
from .._arrays import DeviceArray
from .._kernels import Instance
from .._plans import Builder, Plan, PlanCache

SOURCE = "moe.cu"
THREADS = 256
CHUNK = 2048                 # pairs a block places (moe_chunk_counts / moe_place)
MAX_EXPERTS = 1024           # cuda_src/moe.cu's shared-memory tables (one more bucket: bad ids)
EXPERTS_PER_LANE = (1, 2, 4, 8)   # the router's EPL: up to 256 experts
SCORES = {"softmax": 0, "sigmoid": 1}
INT = ("int32",)


def _router_instance(kind: str, dtype: str, epl: int, score: int, renorm: bool) -> Instance:
    name = "moe_router" if kind == "fwd" else "moe_router_bwd"
    return Instance(SOURCE, f"{name}<{_arrays.DTYPES[dtype][0]}, {epl}, {score}, {str(renorm).lower()}, {THREADS}>",
                    THREADS)


def _rows_instance(kind: str, dtype: str, vec: int) -> Instance:
    t = _arrays.DTYPES[dtype][0]
    if kind == "gather":
        return Instance(SOURCE, f"moe_gather<{t}, {vec}, {THREADS}>", THREADS)
    if kind in ("combine", "sum"):
        return Instance(SOURCE, f"moe_combine<{t}, {vec}, {THREADS}, {'true' if kind == 'combine' else 'false'}>",
                        THREADS)
    return Instance(SOURCE, f"moe_combine_bwd<{t}, {vec}, {THREADS}>", THREADS)


_PLACE = (Instance(SOURCE, f"moe_chunk_counts<{THREADS}, {CHUNK}>", THREADS),
          Instance(SOURCE, f"moe_offsets<{THREADS}>", THREADS),
          Instance(SOURCE, f"moe_place<{THREADS}, {CHUNK}>", THREADS))


def instances() -> list[Instance]:
    """Every kernel instance the functions here can launch (for the compile check)."""
    out = [_router_instance(kind, dtype, epl, score, renorm) for kind in ("fwd", "bwd") for dtype in _arrays.DTYPES
           for epl in EXPERTS_PER_LANE for score in SCORES.values() for renorm in (False, True)]
    out += [_rows_instance(kind, dtype, vec) for kind in ("gather", "combine", "sum", "combine_bwd")
            for dtype, (_, size) in _arrays.DTYPES.items() for vec in sorted({1, 16 // size})]
    return out + list(_PLACE)


# ---- checks ------------------------------------------------------------------------------------

def _dense(a: DeviceArray) -> bool:
    """C-contiguous, or empty (no element to lay out)."""
    return 0 in a.shape or _arrays.is_contiguous(a)


def _score(score) -> int:
    if score not in SCORES:
        raise ValueError(f"score: expected one of {', '.join(map(repr, SCORES))}, got {score!r}")
    return SCORES[score]


def _top_k(top_k, experts: int) -> int:
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= min(experts, 32):
        raise ValueError(f"top_k: must be an int in [1, {min(experts, 32)}] (the experts, at most 32), got {top_k!r}")
    return top_k


def _epl(experts: int) -> int:
    for epl in EXPERTS_PER_LANE:
        if experts <= 32 * epl:
            return epl
    raise ValueError(f"logits: {experts} experts; the router takes at most {32 * EXPERTS_PER_LANE[-1]}")


def _check_logits(la: DeviceArray) -> None:
    if la.ndim != 2:
        raise ValueError(f"logits: expected (tokens, experts), got shape {la.shape}")
    if la.shape[1] < 1:
        raise ValueError("logits: no experts (shape (T, 0))")
    if not _dense(la):
        raise ValueError("logits: must be contiguous")


def _check_pairs(ea: DeviceArray, tokens: int | None = None) -> tuple[int, int]:
    if ea.ndim != 2:
        raise ValueError(f"experts: expected (tokens, top_k), got shape {ea.shape}")
    if tokens is not None and ea.shape[0] != tokens:
        raise ValueError(f"experts: {ea.shape[0]} tokens, expected {tokens}")
    if not _dense(ea):
        raise ValueError("experts: must be contiguous")
    t, k = ea.shape
    if t * k >= 2**31:
        raise ValueError(f"experts: {t} x {k} pairs; at most 2^31 - 1")
    return t, k


def _num_experts(num_experts) -> int:
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or not 1 <= num_experts <= MAX_EXPERTS:
        raise ValueError(f"num_experts: must be an int in [1, {MAX_EXPERTS}], got {num_experts!r}")
    return num_experts


def _fault(device: int):
    """The device's fault record (bad expert ids and rows are reported by cukern.check_errors())."""
    return _arrays.wrap(_faults.record(device), "fault record")


def _rows_layout(cols: int, itemsize: int, arrays) -> tuple[int, int]:
    """(vector width, log2 of the threads a row): enough threads for the row's vectors."""
    vec = _arrays.vector_width(itemsize, cols, arrays)
    tpr = min(THREADS, 1 << max(0, math.ceil(math.log2(max(1, cols // vec)))))
    return vec, tpr.bit_length() - 1


# ---- the router ----------------------------------------------------------------------------------

_ROUTER = PlanCache()
_ROUTER_BWD = PlanCache()


def moe_router(logits, top_k: int, *, score: str = "softmax", renormalize: bool = True, selection_bias=None,
               scale: float = 1.0):
    """Each token's ``top_k`` experts by score, as ``cukern.moe.reference.router``.

    Args:
        logits: (T, E) float32, float16 or bfloat16, contiguous; E <= 256.
        top_k: experts a token, 1 <= top_k <= min(E, 32).
        score: "softmax" (Mixtral, Qwen3-MoE, OLMoE) or "sigmoid" (DeepSeek-V3), in float32.
        renormalize: the chosen scores divided by their sum.
        selection_bias: (E,) float32 or None: added to the scores for the choice alone.
        scale: the weights' factor (DeepSeek-V3's ``routed_scaling_factor``).

    Returns:
        ``(weights (T, k) float32, experts (T, k) int32, counts (E,) int32)``: highest score
        first, ties to the lower expert; counts stay on the device.
    """
    arrays = [_arrays.as_device_array(logits, "logits")]
    if selection_bias is not None:
        arrays.append(_arrays.as_device_array(selection_bias, "selection_bias", ("float32",)))
    scale = _checks._number(scale, "scale")
    key = (top_k, score, bool(renormalize), scale, *(a.key for a in arrays))
    plan = _ROUTER.plan(key, _plan_router, top_k, score, bool(renormalize), scale, arrays)
    bufs = plan(arrays)
    return plan.out(bufs, "weights"), plan.out(bufs, "experts"), plan.out(bufs, "counts")


def _plan_router(top_k, score, renorm, scale, arrays) -> Plan:
    la = arrays[0]
    _check_logits(la)
    tokens, experts = la.shape
    k = _top_k(top_k, experts)
    sc = _score(score)
    bias = arrays[1] if len(arrays) > 1 else None
    if bias is not None and bias.shape != (experts,):
        raise ValueError(f"selection_bias: shape {bias.shape}; expected ({experts},), one an expert")
    epl = _epl(experts)
    device = _arrays.same_device(*arrays)
    b = Builder(arrays)
    w = b.alloc((tokens, k), "float32", name="weights")
    e = b.alloc((tokens, k), "int32", name="experts")
    counts = b.alloc((experts,), "int32", name="counts")
    b.fill(0, counts)
    if tokens:
        kern = _kernels.kernel(_router_instance("fwd", la.dtype, epl, sc, renorm), device)
        b.launch(kern, -(-tokens // (THREADS // 32)), logits=b.slot(0), bias=b.slot(1) if bias is not None else None,
                 weights=w, experts_out=e, counts=counts, tokens=tokens, experts=experts, top_k=k, scale=scale)
    return b.plan(device)


def moe_router_backward(dweights, logits, experts, *, score: str = "softmax", renormalize: bool = True,
                        scale: float = 1.0):
    """d logits (T, E) of ``moe_router``'s weights, in the logits' dtype: ``dweights`` (T, k)
    float32 and the ``experts`` (T, k) int32 the forward chose (held fixed)."""
    arrays = [_arrays.as_device_array(dweights, "dweights", ("float32",)), _arrays.as_device_array(logits, "logits"),
              _arrays.as_device_array(experts, "experts", INT)]
    scale = _checks._number(scale, "scale")
    key = (score, bool(renormalize), scale, *(a.key for a in arrays))
    plan = _ROUTER_BWD.plan(key, _plan_router_backward, score, bool(renormalize), scale, arrays)
    return plan.out(plan(arrays), "dlogits")


def _plan_router_backward(score, renorm, scale, arrays) -> Plan:
    da, la, ea = arrays
    _check_logits(la)
    tokens, experts = la.shape
    _, k = _check_pairs(ea, tokens)
    _top_k(k, experts)
    if da.shape != ea.shape or not _dense(da):
        raise ValueError(f"dweights: shape {da.shape}, expected {ea.shape} (contiguous)")
    sc = _score(score)
    epl = _epl(experts)
    device = _arrays.same_device(*arrays)
    b = Builder(arrays)
    dl = b.alloc((tokens, experts), la.dtype, name="dlogits")
    if tokens:
        kern = _kernels.kernel(_router_instance("bwd", la.dtype, epl, sc, renorm), device)
        b.launch(kern, -(-tokens // (THREADS // 32)), dweights=b.slot(0), logits=b.slot(1), experts_in=b.slot(2),
                 dlogits=dl, tokens=tokens, experts=experts, top_k=k, scale=scale)
    return b.plan(device)


# ---- the permutation ------------------------------------------------------------------------------

_PERMUTE = PlanCache()
_UNPERMUTE = PlanCache()
_UNPERMUTE_BWD = PlanCache()
_PERMUTE_BWD = PlanCache()


def moe_permute(x, experts, num_experts: int):
    """Tokens grouped by expert, as ``cukern.moe.reference.permute``.

    Args:
        x: (T, H) float32, float16 or bfloat16 (rows with a stride of their own read in place).
        experts: (T, k) int32 (``moe_router``'s), each in [0, num_experts).
        num_experts: E, at most 1024.

    Returns:
        ``(x_perm (T k, H), order (T k,) int32, row_of (T k,) int32, offsets (E + 1,) int32,
        counts (E,) int32)``: row r of x_perm is token order[r] // k's; expert e's rows are
        offsets[e]:offsets[e + 1], in token order; pair t * k + j is at row row_of[t * k + j].
    """
    arrays = [_arrays.as_device_array(x, "x"), _arrays.as_device_array(experts, "experts", INT)]
    key = (num_experts, *(a.key for a in arrays))
    plan = _PERMUTE.plan(key, _plan_permute, num_experts, arrays)
    bufs = plan(arrays)
    return tuple(plan.out(bufs, n) for n in ("x_perm", "order", "row_of", "offsets", "counts"))


def _x_rows(b: Builder, i: int, xa: DeviceArray) -> int:
    """x's row stride, read in place where the layout allows (else a contiguous copy)."""
    copy, stride = _arrays.rows_view(xa)
    if copy:
        b.fix(i, DeviceArray.contiguous)
        return xa.shape[-1]
    return stride


def _plan_permute(num_experts, arrays) -> Plan:
    xa, ea = arrays
    n = _num_experts(num_experts)
    if xa.ndim != 2:
        raise ValueError(f"x: expected (tokens, hidden), got shape {xa.shape}")
    tokens, k = _check_pairs(ea, xa.shape[0])
    pairs, cols = tokens * k, xa.shape[1]
    device = _arrays.same_device(xa, ea)
    b = Builder(arrays)
    xp = b.alloc((pairs, cols), xa.dtype, name="x_perm")
    order = b.alloc((pairs,), "int32", name="order")
    row_of = b.alloc((pairs,), "int32", name="row_of")
    offsets = b.alloc((n + 1,), "int32", name="offsets")
    counts = b.alloc((n,), "int32", name="counts")
    chunks = max(1, -(-pairs // CHUNK))
    scratch = b.alloc((chunks, n + 1), "int32")   # (a bucket after the last expert: out-of-range ids)
    fault = _fault(device)
    count_k, offsets_k, place_k = (_kernels.kernel(i, device) for i in _PLACE)
    b.launch(count_k, chunks, experts_in=b.slot(1), chunk_counts=scratch, pairs=pairs, experts=n, fault=fault)
    b.launch(offsets_k, 1, chunk_counts=scratch, offsets=offsets, counts=counts, chunks=chunks, experts=n)
    if pairs:
        b.launch(place_k, chunks, experts_in=b.slot(1), chunk_base=scratch, order=order, row_of=row_of, pairs=pairs,
                 experts=n)
        if cols:
            stride = _x_rows(b, 0, xa)
            vec, log2 = _rows_layout(cols, xa.itemsize, [(xa, stride)])
            kern = _kernels.kernel(_rows_instance("gather", xa.dtype, vec), device)
            b.launch(kern, -(-pairs // (THREADS >> log2)), x=b.slot(0), x_stride=stride, order=order, x_perm=xp,
                     pairs=pairs, cols=cols, top_k=k, tpr_log2=log2)
    return b.plan(device)


def moe_unpermute(y_perm, row_of, weights):
    """The weighted combine back, as ``cukern.moe.reference.unpermute``: out (T, H) in
    y_perm's dtype, token t's rows (``row_of[t * k + j]``) times ``weights[t, j]`` summed in
    float32. y_perm (T k, H) contiguous; row_of (T k,) int32; weights (T, k) float32."""
    arrays = [_arrays.as_device_array(y_perm, "y_perm"), _arrays.as_device_array(row_of, "row_of", INT),
              _arrays.as_device_array(weights, "weights", ("float32",))]
    plan = _UNPERMUTE.plan(tuple(a.key for a in arrays), _plan_combine, None, arrays)
    return plan.out(plan(arrays), "out")


def moe_permute_backward(dx_perm, row_of, top_k: int):
    """dx (T, H) of ``moe_permute``'s x_perm: each token's k rows of ``dx_perm`` (T k, H)
    summed in float32."""
    arrays = [_arrays.as_device_array(dx_perm, "dx_perm"), _arrays.as_device_array(row_of, "row_of", INT)]
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k: must be a positive int dividing the {arrays[0].shape[0] if arrays[0].ndim else 0} "
                         f"rows, got {top_k!r}")
    plan = _PERMUTE_BWD.plan((top_k, *(a.key for a in arrays)), _plan_combine, top_k, arrays)
    return plan.out(plan(arrays), "out")


def _plan_combine(top_k, arrays) -> Plan:
    """``top_k`` None: weighted by arrays[2] (T, k); an int: unweighted, k rows a token."""
    ya, ra = arrays[0], arrays[1]
    wa = arrays[2] if top_k is None else None
    if ya.ndim != 2 or not _dense(ya):
        raise ValueError(f"{ya.name}: expected contiguous (pairs, hidden), got shape {ya.shape}")
    if ra.ndim != 1 or ra.shape[0] != ya.shape[0] or not _dense(ra):
        raise ValueError(f"row_of: shape {ra.shape}, expected ({ya.shape[0]},) (contiguous)")
    if wa is not None:
        if wa.ndim != 2 or wa.shape[0] * wa.shape[1] != ya.shape[0] or not _dense(wa):
            raise ValueError(f"weights: shape {wa.shape}; expected contiguous (tokens, top_k) with tokens * top_k "
                             f"= {ya.shape[0]}")
        tokens, k = wa.shape
    else:
        if ya.shape[0] % top_k:
            raise ValueError(f"top_k: must be a positive int dividing the {ya.shape[0]} rows, got {top_k!r}")
        tokens, k = ya.shape[0] // top_k, top_k
    cols = ya.shape[1]
    device = _arrays.same_device(*arrays)
    b = Builder(arrays)
    out = b.alloc((tokens, cols), ya.dtype, name="out")
    if tokens and cols:
        vec, log2 = _rows_layout(cols, ya.itemsize, [(ya, cols)])
        kern = _kernels.kernel(_rows_instance("combine" if wa is not None else "sum", ya.dtype, vec), device)
        b.launch(kern, -(-tokens // (THREADS >> log2)), y=b.slot(0), row_of=b.slot(1),
                 weights=b.slot(2) if wa is not None else None, out=out, tokens=tokens, cols=cols, top_k=k,
                 tpr_log2=log2, fault=_fault(device))
    return b.plan(device)


def moe_unpermute_backward(dout, y_perm, row_of, weights):
    """Gradients of ``moe_unpermute``: ``(dy_perm (T k, H) in y_perm's dtype, dweights (T, k)
    float32)``; dout (T, H) contiguous of y_perm's dtype."""
    arrays = [_arrays.as_device_array(dout, "dout"), _arrays.as_device_array(y_perm, "y_perm"),
              _arrays.as_device_array(row_of, "row_of", INT), _arrays.as_device_array(weights, "weights", ("float32",))]
    plan = _UNPERMUTE_BWD.plan(tuple(a.key for a in arrays), _plan_combine_backward, arrays)
    bufs = plan(arrays)
    return plan.out(bufs, "dy_perm"), plan.out(bufs, "dweights")


def _plan_combine_backward(arrays) -> Plan:
    da, ya, ra, wa = arrays
    if ya.ndim != 2 or not _dense(ya):
        raise ValueError(f"y_perm: expected contiguous (pairs, hidden), got shape {ya.shape}")
    if wa.ndim != 2 or wa.shape[0] * wa.shape[1] != ya.shape[0] or not _dense(wa):
        raise ValueError(f"weights: shape {wa.shape}; expected contiguous (tokens, top_k) with tokens * top_k = "
                         f"{ya.shape[0]}")
    tokens, k = wa.shape
    if da.shape != (tokens, ya.shape[1]) or da.dtype != ya.dtype or not _dense(da):
        raise ValueError(f"dout: shape {da.shape} {da.dtype}; expected contiguous {(tokens, ya.shape[1])} {ya.dtype}")
    if ra.shape != (ya.shape[0],) or not _dense(ra):
        raise ValueError(f"row_of: shape {ra.shape}, expected ({ya.shape[0]},) (contiguous)")
    pairs, cols = ya.shape
    device = _arrays.same_device(*arrays)
    b = Builder(arrays)
    dy = b.alloc((pairs, cols), ya.dtype, name="dy_perm")
    dw = b.alloc((tokens, k), "float32", name="dweights")
    if pairs:
        if not cols:
            b.fill(0, dw)
        else:
            vec = _arrays.vector_width(ya.itemsize, cols, [(ya, cols), (da, cols)])
            kern = _kernels.kernel(_rows_instance("combine_bwd", ya.dtype, vec), device)
            b.launch(kern, -(-pairs // (THREADS // 32)), dout=b.slot(0), y=b.slot(1), row_of=b.slot(2),
                     weights=b.slot(3), dy_perm=dy, dweights=dw, pairs=pairs, cols=cols, top_k=k,
                     fault=_fault(device))
    return b.plan(device)
