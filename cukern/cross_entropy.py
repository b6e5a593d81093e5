"""Cross-entropy of logits against integer targets, forward and backward, and the training form
that reads the logits once for both (kernels: cuda_src/cross_entropy.cu).

Shapes: ``logits`` (*, V), the classes on the last axis; ``target`` (*), int32 or int64.
dtypes: logits float32, float16 or bfloat16; arithmetic in float32; the loss in the logits'
dtype (as PyTorch's), the log-sum-exp float32.

Options (every function): ``ignore_index`` (rows with that target get loss 0 and no gradient),
``label_smoothing`` (PyTorch's), ``z_loss`` (adds z_loss · lse² a row, PaLM), ``softcap``
(the softmax sees c · tanh(x / c), Gemma 2; None or 0: none), ``reduction`` "mean" (over the rows not
ignored; NaN when all are, as PyTorch's), "sum" or "none".

A target outside [0, V) other than ignore_index is recorded on the device, its row ignored, and
raised as ``IndexError`` by ``cukern.check_errors()``: no host sync on the hot path.

The family's Python side: configurations, array functions with launch plans, the NumPy
references, benchmark cases and the PyTorch bindings (``FAMILY`` at the end).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from . import _arrays, _checks, _faults, _kernels
from ._bench_cases import Case, TorchCase, elements_bytes, generator, randn
from ._arrays import DeviceArray
from ._family import DropIn, Family, TorchOp
from ._kernels import Instance
from ._plans import Builder, Plan, PlanCache

__all__ = ["cross_entropy", "cross_entropy_backward", "cross_entropy_forward_backward", "linear_cross_entropy",
           "linear_cross_entropy_forward_backward", "chunk_rows"]

SOURCE = "cross_entropy.cu"
INDEX_CTYPES = {"int32": "int", "int64": "long long"}
REDUCTIONS = ("mean", "sum", "none")
FORWARD, TRAIN, BACKWARD = 0, 1, 2   # the row kernel's MODE


# ---- kernel configurations --------------------------------------------------------------------

@dataclass(frozen=True, eq=False)   # (hashed by identity: plans are keyed by it, on every call)
class Configs:
    """A block of ``threads`` a row (each thread loads 4 vectors a step); the count and reduce
    kernels run one block of ``single_threads``; the gradient scaling ``scale_threads`` a row."""
    threads: int = 512
    single_threads: int = 1024
    scale_threads: int = 256
    blocks_per_sm: int = 0   # the row kernel's grid: 0 = as many as fit (measured: docs/notes-cross-entropy.md)
    # The training form on sm_90+: a row over a cluster of CTAs (of the first of `clusters` sizes
    # and `cluster_threads` threads, taken threads first, that holds its part of the row with one
    # of the `cluster_nv` 16-byte vectors a thread, the fewest). The smallest cluster of 256-thread
    # CTAs whose part (at most 32 KB) is staged in shared memory: six CTAs an SM, the fewest
    # barriers a row (bf16, H200: 128256 classes 2.30 ms on 8 CTAs against 3.15 in two passes;
    # 32000 0.57 on 2 against 0.72; 8192 0.244 on 2 against 0.265). A cluster of 16 is beyond the
    # portable size (the front allows it per kernel). Rows of fewer than `cluster_min` classes keep
    # the two-pass kernel (docs/notes-cross-entropy.md, v2 to v3).
    clusters: tuple[int, ...] = (2, 4, 8)
    cluster_threads: tuple[int, ...] = (256,)
    cluster_nv: tuple[int, ...] = (1, 2, 4, 8)
    cluster_min: int = 8192
    use_cluster: bool = True
    # A cluster a row (the hardware schedules the next row's CTAs as others finish, so one CTA's
    # loads overlap another's reductions) or, persistent, as many clusters as fit looping over
    # rows (measured 1.9x slower: a row's load, reductions and barrier then run back to back).
    cluster_persistent: bool = False
    max_clusters: int = 1 << 27   # the cluster kernel's grid at most (it loops over the rest)
    # CTAs of these sizes stage their part of the row in shared memory by cp.async instead of
    # holding it in registers: 256-thread CTAs go from four an SM to six (7-19% faster); 128-thread
    # ones measured 5% slower staged.
    cluster_stage: tuple[int, ...] = (256,)

    def cluster_vectors(self, v: int, vec: int) -> tuple[int, int, int] | None:
        """(cluster, threads, nv) that hold a row of ``v`` classes, or None (too wide)."""
        for threads in self.cluster_threads:
            for cluster in self.clusters:
                cols = -(-v // cluster)      # columns a CTA, then vectors (as the kernel splits the row)
                per = -(-cols // vec)
                for nv in self.cluster_nv:
                    if nv * threads >= per:
                        return cluster, threads, nv
        return None

    def train_cluster(self, dtype: str, index: str, cluster: int, threads: int, nv: int) -> Instance:
        vec = 16 // _arrays.DTYPES[dtype][1]
        return Instance(SOURCE, f"cross_entropy_train_cluster<{_arrays.DTYPES[dtype][0]}, {INDEX_CTYPES[index]}, "
                                f"{vec}, {threads}, {nv}, {cluster}, {int(threads in self.cluster_stage)}>", threads,
                        cluster=cluster)

    def rows(self, dtype: str, index: str, vec: int, mode: int, dloss_dtype: str = "float32") -> Instance:
        return Instance(SOURCE, f"cross_entropy_rows<{_arrays.DTYPES[dtype][0]}, {INDEX_CTYPES[index]}, {vec}, "
                                f"{self.threads}, {mode}, {_arrays.DTYPES[dloss_dtype][0]}>", self.threads)

    def count(self, index: str) -> Instance:
        return Instance(SOURCE, f"cross_entropy_count<{INDEX_CTYPES[index]}, {self.single_threads}>",
                        self.single_threads)

    def reduce(self, dtype: str) -> Instance:
        return Instance(SOURCE, f"cross_entropy_reduce<{_arrays.DTYPES[dtype][0]}, {self.single_threads}>",
                        self.single_threads)

    def cast(self, dtype: str) -> Instance:
        return Instance(SOURCE, f"cross_entropy_cast<{_arrays.DTYPES[dtype][0]}>", 256)

    def scale(self, src_dtype: str, dtype: str, loss_dtype: str, vec: int) -> Instance:
        return Instance(SOURCE, f"cross_entropy_scale<{_arrays.DTYPES[src_dtype][0]}, {_arrays.DTYPES[dtype][0]}, "
                                f"{_arrays.DTYPES[loss_dtype][0]}, {vec}, {self.scale_threads}>", self.scale_threads)


CONFIGS = Configs()


def instances(configs: Configs = CONFIGS) -> list[Instance]:
    """Every kernel instance the fronts can launch (for the compile check)."""
    out = []
    for dtype, (_, itemsize) in _arrays.DTYPES.items():
        loss_dtypes = sorted({"float32", dtype})
        for vec in sorted({1, 16 // itemsize}):
            for index in INDEX_CTYPES:
                out += [configs.rows(dtype, index, vec, mode) for mode in (FORWARD, TRAIN)]
                out += [configs.rows(dtype, index, vec, BACKWARD, ld) for ld in loss_dtypes]
                if vec > 1:
                    out += [configs.train_cluster(dtype, index, cluster, threads, nv) for cluster in configs.clusters
                            for threads in configs.cluster_threads for nv in configs.cluster_nv]
        # (the linear cross-entropy's gradients, kept in float32, scaled into their dtype)
        out += [configs.scale("float32", dtype, ld, vec) for ld in loss_dtypes for vec in (1, 4)]
        out += [configs.reduce(dtype), configs.cast(dtype)]
    return out + [configs.count(index) for index in INDEX_CTYPES]


# ---- argument checks (kernels and references alike) -----------------------------------------

@dataclass(frozen=True)
class Options:
    """The checked scalar options of a call (part of its plan's key)."""
    ignore_index: int
    smoothing: float
    z_loss: float
    softcap: float   # 0: none
    reduction: str


def _options(ignore_index, label_smoothing, z_loss, softcap, reduction) -> Options:
    ignore = _checks.index(ignore_index, "ignore_index")
    if not -2**63 <= ignore < 2**63:
        raise ValueError(f"ignore_index: {ignore} does not fit in int64")
    smoothing = _checks.eps(label_smoothing, "label_smoothing")
    if smoothing > 1.0:
        raise ValueError(f"label_smoothing: must be in [0, 1], got {label_smoothing}")
    z = _checks.eps(z_loss, "z_loss")
    cap = _checks.softcap(softcap)
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction: must be one of {', '.join(map(repr, REDUCTIONS))}, got {reduction!r}")
    return Options(ignore, smoothing, z, cap, reduction)


def _check_rows(la: DeviceArray, ta: DeviceArray) -> None:
    if la.ndim < 1:
        raise ValueError(f"{la.name}: must have at least one axis (the classes, last), got a scalar")
    if la.shape[-1] < 1:
        raise ValueError(f"{la.name}: the class axis (last) is empty: shape {la.shape}")
    if ta.shape != la.shape[:-1]:
        raise ValueError(f"{ta.name}: shape {ta.shape} does not match the leading shape of {la.name}, {la.shape[:-1]}")


def _loss_shape(ta: DeviceArray, reduction: str) -> tuple:
    return ta.shape if reduction == "none" else ()


def _check_backward(sa: DeviceArray, ta: DeviceArray) -> None:
    if sa.dtype not in ("float32", "float64") or sa.shape != ta.shape:
        raise ValueError(f"{sa.name}: must be float32 of shape {ta.shape} (the forward's lse), "
                         f"got {sa.dtype} {sa.shape}")


def _target(obj) -> DeviceArray:
    return _arrays.as_device_array(obj, "target", tuple(INDEX_CTYPES))


def _vector_width(la: DeviceArray, stride: int, d_stride: int) -> int:
    """16-byte vectors when every row of the logits (and of the gradient, whose new buffers are
    aligned, and which in place shares the logits' rows) starts 16-byte aligned."""
    vec = 16 // la.itemsize
    if la.shape[-1] % vec or stride % vec or d_stride % vec or la.ptr % 16:
        return 1
    return vec


def _rows_layout(b: Builder, slot: int, la: DeviceArray) -> int:
    """The row stride the kernels read ``la`` with; a contiguous copy when its rows cannot be
    read as one strided axis with unit-stride classes."""
    stride = la.row_stride()
    if stride is None or la.ndim == 1:
        if stride is None:
            b.fix(slot, DeviceArray.contiguous)
        return la.shape[-1]
    return stride


# ---- the fronts --------------------------------------------------------------------------------

_PLANS = PlanCache()


def _loss_dtype(loss_dtype, la: DeviceArray) -> str:
    if loss_dtype is None:
        return la.dtype
    name = str(loss_dtype).replace("torch.", "")
    if name not in ("float32", la.dtype):
        raise ValueError(f"loss_dtype: must be float32 or the logits' dtype ({la.dtype}), got {loss_dtype}")
    return name


def cross_entropy(logits, target, *, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None,
                  reduction="mean", return_lse=False, loss_dtype=None):
    """The cross-entropy loss of ``logits`` against ``target`` (see the module for the options).

    Args:
        logits: (*, V) float32, float16 or bfloat16 (rows may be strided; the class axis must
            be unit-stride, else a copy is read).
        target: (*) int32 or int64 class indices.
        loss_dtype: the loss's dtype: the logits' (default, as PyTorch's) or "float32" (as
            PyTorch's under autocast, which computes the loss of half logits in float32).

    Returns:
        the loss: () for "mean" and "sum", (*) for "none"; with ``return_lse`` also (*)
        float32 log-sum-exp of each row (of the softcapped logits).
    """
    opts = _options(ignore_index, label_smoothing, z_loss, softcap, reduction)
    arrays = [_arrays.as_device_array(logits, "logits"), _target(target)]
    flags = (bool(return_lse), False, _loss_dtype(loss_dtype, arrays[0]))
    bufs = _run(FORWARD, arrays, opts, flags, CONFIGS)
    return (bufs[2].obj, bufs[3].obj) if return_lse else bufs[2].obj


def cross_entropy_forward_backward(logits, target, *, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                                   softcap=None, reduction="mean", inplace=False, return_lse=False, loss_dtype=None):
    """The training form: the loss and its gradient with respect to the logits (for an
    upstream gradient of 1) in one kernel, which reads each row of the logits for its
    statistics and once more, right after, for the gradient.

    Args:
        logits, target, options, loss_dtype: as ``cross_entropy``.
        inplace: write the gradient into ``logits`` (its memory is reused; the logits are
            gone after the call) instead of a new array.

    Returns:
        (loss, dlogits[, lse]): loss as ``cross_entropy``; dlogits of the logits' shape and
        dtype (``logits`` itself with ``inplace``).
    """
    opts = _options(ignore_index, label_smoothing, z_loss, softcap, reduction)
    arrays = [_arrays.as_device_array(logits, "logits"), _target(target)]
    flags = (bool(return_lse), bool(inplace), _loss_dtype(loss_dtype, arrays[0]))
    bufs = _run(TRAIN, arrays, opts, flags, CONFIGS)
    out = (bufs[2].obj, bufs[0].obj if inplace else bufs[4].obj)
    return out + (bufs[3].obj,) if return_lse else out


def cross_entropy_backward(dloss, logits, target, lse, *, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                           softcap=None, reduction="mean"):
    """The gradient of ``cross_entropy`` with respect to the logits.

    Args:
        dloss: the upstream gradient (the loss's shape: () for "mean" and "sum", (*) for
            "none"; float32 or the logits' dtype).
        logits, target, options: as given to the forward.
        lse: (*) float32, the forward's ``return_lse`` output.

    Returns:
        dlogits: the logits' shape and dtype, contiguous.
    """
    opts = _options(ignore_index, label_smoothing, z_loss, softcap, reduction)
    return _backward(dloss, logits, target, lse, None, opts, donate=False)


def _backward(dloss, logits, target, lse, unit, opts: Options, donate: bool):
    """The backward, given (``unit``, or None) the gradient the training form wrote for an
    upstream gradient of 1: rows whose upstream gradient is exactly 1 take it, the others are
    computed from the logits (the upstream gradient applied before the one rounding). With
    ``donate`` the result is written over ``unit`` (which must then not be read again)."""
    arrays = [_arrays.as_device_array(logits, "logits"), _target(target),
              _arrays.as_device_array(dloss, "dloss"), _arrays.as_device_array(lse, "lse", ("float32",))]
    if unit is not None:
        arrays.append(_arrays.as_device_array(unit, "unit"))
    elif donate:
        raise ValueError("unit: donate writes the gradient over unit, which is absent")
    n = len(arrays)   # (the plan's buffers: these, then what it allocates)
    bufs = _run(BACKWARD, arrays, opts, (bool(donate),), CONFIGS)
    return bufs[4 if donate else n].obj


def _run(mode: int, arrays: list, opts: Options, flags: tuple, configs: Configs) -> list:
    key = (mode, opts, flags, configs, *(a.key for a in arrays))
    plan = _PLANS.get(key) or _PLANS.put(key, _plan(mode, arrays, opts, flags, configs))
    return plan(arrays)


def _check_dloss(da: DeviceArray, la: DeviceArray, shape) -> None:
    if da.dtype not in ("float32", la.dtype):
        raise ValueError(f"{da.name}: dtype {da.dtype} is neither float32 nor the logits' {la.dtype}")
    if da.shape != tuple(shape):
        raise ValueError(f"{da.name}: shape {da.shape} does not match the loss's {tuple(shape)}")


def _check_unit(ua: DeviceArray, la: DeviceArray) -> None:
    if ua.dtype != la.dtype or ua.shape != la.shape or not _arrays.is_contiguous(ua):
        raise ValueError(f"{ua.name}: must be the training form's gradient, contiguous {la.dtype} of shape "
                         f"{la.shape}, got {ua.dtype} {ua.shape} strides {ua.strides}")


def _dloss_stride(b: Builder, da: DeviceArray, rows: int, none: bool) -> int:
    """The upstream gradient's stride a row: 0 for a scalar (or one broadcast to every row, as
    ``loss.sum()`` gives ``none``), 1 for one value a row (a contiguous copy where it is strided)."""
    if not none or rows <= 1 or all(s == 0 for s in da.strides):
        return 0
    if not _arrays.is_contiguous(da):
        b.fix(2, DeviceArray.contiguous)
    return 1


def _plan(mode: int, arrays: list, opts: Options, flags: tuple, configs: Configs) -> Plan:
    """Buffers: logits, target[, dloss, lse[, unit]], then for the forward and the training form:
    loss, lse (absent unless asked), dlogits (training form, absent in place or in the forward),
    then scratch; for the backward: dlogits (absent where it is written over unit), then scratch."""
    la, ta = arrays[:2]
    _check_rows(la, ta)
    if mode == BACKWARD:
        _check_dloss(arrays[2], la, _loss_shape(ta, opts.reduction))
        _check_backward(arrays[3], ta)
        if len(arrays) > 4:
            _check_unit(arrays[4], la)
    device = _arrays.same_device(*arrays)
    rows, v = math.prod(ta.shape), la.shape[-1]
    b = Builder(arrays)
    if mode == TRAIN and flags[1] and la.row_stride() is None:
        raise ValueError(f"{la.name}: inplace needs rows with a unit-stride class axis (one strided row axis); "
                         f"strides {la.strides} would be copied first")
    stride = _rows_layout(b, 0, la)
    if not _arrays.is_contiguous(ta):
        b.fix(1, DeviceArray.contiguous)
    mean, none = opts.reduction == "mean", opts.reduction == "none"
    dloss = lse = loss = loss_rows = unit = None
    dloss_stride, d_stride = 0, 0
    if mode == BACKWARD:
        dloss_stride = _dloss_stride(b, arrays[2], rows, none)
        if not _arrays.is_contiguous(arrays[3]):
            b.fix(3, DeviceArray.contiguous)
        unit = b.slot(4) if len(arrays) > 4 else None
        if flags[0]:   # donated: written over the training form's gradient
            dlogits, d_stride = unit, v
            b.absent()
        else:
            dlogits, d_stride = b.alloc(la.shape, la.dtype), v
        dloss, lse = b.slot(2), b.slot(3)
    else:
        return_lse, inplace, loss_dtype = flags[:3]
        # "none" in float32: the kernel's per-row losses are the output
        loss = b.alloc(_loss_shape(ta, opts.reduction), loss_dtype)
        if none and loss_dtype == "float32":
            loss_rows = loss
        lse = b.alloc(ta.shape, "float32") if return_lse else b.absent()
        dlogits = None
        if mode == TRAIN and inplace:
            dlogits, d_stride = b.slot(0), stride
        if mode == TRAIN and not inplace:
            dlogits, d_stride = b.alloc(la.shape, la.dtype), v
        else:
            b.absent()
        if loss_rows is None and rows:
            loss_rows = b.alloc((rows,), "float32")
    # a count given (the linear cross-entropy's chunks: per-row losses, the gradient scaled by the
    # rows kept in the whole batch) or, for "mean", counted here
    shared = mode == TRAIN and len(flags) > 3 and flags[3]
    count = b.slot(2) if shared else b.alloc((1,), "float32") if mean else None
    if rows == 0:   # no rows: the mean of nothing is NaN, the sum 0 (PyTorch's)
        if loss is not None and not none:
            b.fill(math.nan if mean else 0.0, loss)
        return b.plan(device)
    fault = _arrays.wrap(_faults.record(device), "fault record")
    if mean and not shared:
        k = _kernels.kernel(configs.count(ta.dtype), device)
        b.launch(k, 1, target=b.slot(1), rows=rows, V=v, ignore_index=opts.ignore_index, count=count)
    vec = _vector_width(la, stride, d_stride)
    if unit is not None and arrays[4].ptr % 16:
        vec = 1
    common = dict(logits=b.slot(0), x_stride=stride, target=b.slot(1), rows=rows, V=v,
                  ignore_index=opts.ignore_index, smoothing=opts.smoothing, z_loss=opts.z_loss,
                  softcap=opts.softcap, loss_rows=loss_rows, lse=lse, count=count, dlogits=dlogits,
                  d_stride=d_stride, fault=fault)
    shape = configs.cluster_vectors(v, vec)
    if (mode == TRAIN and configs.use_cluster and vec > 1 and shape is not None and v >= configs.cluster_min
            and _kernels.compute_capability(device) >= (9, 0)):
        cluster = shape[0]
        k = _kernels.kernel(configs.train_cluster(la.dtype, ta.dtype, *shape), device)
        clusters = min(rows, configs.max_clusters)
        if configs.cluster_persistent:
            clusters = max(1, min(clusters, k.resident_blocks() // cluster))
        b.launch(k, clusters * cluster, **common)
    else:
        dloss_dtype = arrays[2].dtype if mode == BACKWARD else "float32"
        k = _kernels.kernel(configs.rows(la.dtype, ta.dtype, vec, mode, dloss_dtype), device)
        grid = configs.blocks_per_sm * _kernels.sm_count(device) if configs.blocks_per_sm else k.resident_blocks()
        b.launch(k, min(rows, grid), dloss=dloss, dloss_stride=dloss_stride, unit=unit, **common)
    if mode != BACKWARD and not none:
        k = _kernels.kernel(configs.reduce(flags[2]), device)
        b.launch(k, 1, loss_rows=loss_rows, rows=rows, count=count, out=loss)
    elif mode != BACKWARD and loss_rows is not loss:
        k = _kernels.kernel(configs.cast(flags[2]), device)
        b.launch(k, min(-(-rows // 256), 4 * _kernels.sm_count(device)), src=loss_rows, n=rows, dst=loss)
    return b.plan(device)


# ---- linear cross-entropy: the LM head and the loss without the (T, V) logits ------------------

# Bytes of logits a chunk of tokens may hold: the extra memory of the linear cross-entropy
# besides dweight's float32 accumulator. 512 MiB: 2048 tokens at V = 128256 in bf16. Each chunk's
# dweight product reads and writes the float32 accumulator, so fewer, longer chunks pay for it:
# 84 ms against 91 at 256 MiB (docs/notes-cross-entropy.md, v3).
CHUNK_BYTES = 512 << 20
_COUNT = PlanCache()


def chunk_rows(tokens: int, v: int, itemsize: int, budget: int | None = None) -> int:
    """Tokens a chunk: the largest power of two whose logits fit ``budget`` bytes (default
    ``CHUNK_BYTES``; at least one token), at most the number of tokens rounded up to a power of two."""
    budget = CHUNK_BYTES if budget is None else budget
    rows = 1 << max(0, (budget // max(1, v * itemsize)).bit_length() - 1)
    return min(rows, 1 << max(0, (tokens - 1).bit_length()))


def _count_valid(ta: DeviceArray, v: int, opts: Options, configs: Configs = CONFIGS):
    """(1,) float32 on the device: the targets that are neither ignore_index nor out of range."""
    key = (v, opts.ignore_index, configs, ta.key)
    plan = _COUNT.get(key)
    if plan is None:
        b = Builder([ta])
        count = b.alloc((1,), "float32")
        if ta.size:
            k = _kernels.kernel(configs.count(ta.dtype), ta.device)
            b.launch(k, 1, target=b.slot(0), rows=ta.size, V=v, ignore_index=opts.ignore_index, count=count)
        else:
            b.fill(0.0, count)
        plan = _COUNT.put(key, b.plan(ta.device))
    return plan([ta])[1]


def _chunk_train(logits, target, count, opts: Options):
    """The training form on one chunk of logits, in place: the chunk's per-row float32 losses;
    the gradient, written over the logits, is scaled by 1 / ``count`` (for "mean") — the kept
    rows of the whole batch, not the chunk's."""
    arrays = [_arrays.as_device_array(logits, "logits"), _target(target),
              _arrays.as_device_array(count, "count", ("float32",)) if count is not None else None]
    chunk_opts = Options(opts.ignore_index, opts.smoothing, opts.z_loss, opts.softcap, "none")
    if count is None:
        arrays.pop()
    flags = (False, True, "float32", count is not None)
    return _run(TRAIN, arrays, chunk_opts, flags, CONFIGS)[3 if count is not None else 2].obj


def _chunk_forward(logits, target, opts: Options):
    arrays = [_arrays.as_device_array(logits, "logits"), _target(target)]
    chunk_opts = Options(opts.ignore_index, opts.smoothing, opts.z_loss, opts.softcap, "none")
    return _run(FORWARD, arrays, chunk_opts, (False, False, "float32"), CONFIGS)[2].obj


def _addmm(out, a, b) -> None:
    """out += a @ b, ``out`` float32 or of the inputs' dtype. torch: one cuBLAS call that
    accumulates into ``out`` in float32 (out_dtype) where the inputs are half; CuPy: through a
    temporary, the product rounded to the inputs' dtype before it is added."""
    if hasattr(out, "addmm_"):
        if out.dtype == a.dtype:
            out.addmm_(a, b)
        else:
            import torch

            torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
    else:
        out += a @ b


def _mm_into(out, a, b) -> None:
    """out[...] = a @ b (torch: written in place by cuBLAS, which rounds its float32 sums once to
    ``out``'s dtype, float32 too for half inputs)."""
    if hasattr(out, "addmm_"):
        import torch

        if out.dtype == a.dtype:
            torch.matmul(a, b, out=out)
        else:
            torch.mm(a, b, out_dtype=out.dtype, out=out)
    else:
        out[...] = a @ b


def _chunk_logits(hc, w, bias):
    """hc @ w.T (+ bias) in the inputs' dtype (torch: the bias added by the same cuBLAS call)."""
    if bias is not None and hasattr(hc, "addmm_"):
        import torch

        return torch.addmm(bias, hc, w.T)
    logits = hc @ w.T
    if bias is not None:
        logits += bias
    return logits


def _module(a: DeviceArray):
    """The array module of ``a`` (numpy, cupy or torch)."""
    import importlib

    return importlib.import_module({"numpy": "numpy", "cupy": "cupy", "torch": "torch"}[a.kind])


def _check_linear(ha: DeviceArray, wa: DeviceArray, ta: DeviceArray, ba: DeviceArray | None) -> None:
    if ha.ndim < 1:
        raise ValueError(f"{ha.name}: must have at least one axis (the hidden size, last), got a scalar")
    if wa.ndim != 2 or wa.shape[1] != ha.shape[-1]:
        raise ValueError(f"{wa.name}: must be (V, {ha.shape[-1]}) (classes, hidden size), got shape {wa.shape}")
    if wa.shape[0] < 1:
        raise ValueError(f"{wa.name}: no classes (shape {wa.shape})")
    _checks.like(wa, ha, wa.shape)
    _checks.like(ba, ha, (wa.shape[0],))
    if ta.shape != ha.shape[:-1]:
        raise ValueError(f"{ta.name}: shape {ta.shape} does not match the leading shape of {ha.name}, {ha.shape[:-1]}")


def _linear_inputs(hidden, weight, target, bias):
    ha, wa = _arrays.as_device_array(hidden, "hidden"), _arrays.as_device_array(weight, "weight")
    ta = _target(target)
    ba = None if bias is None else _arrays.as_device_array(bias, "bias")
    _check_linear(ha, wa, ta, ba)
    _arrays.same_device(ha, wa, ta, ba)
    if ha.kind == "cupy" and ha.dtype == "bfloat16":
        raise TypeError("hidden: CuPy has no bfloat16 matrix product; pass torch tensors (zero copy through "
                        "torch.from_dlpack) or float16/float32 arrays")
    return ha, wa, ta, ba


def _reduce_rows(loss_rows, count, reduction: str, like: DeviceArray, dtype: str):
    """The per-row float32 losses reduced as asked, in ``dtype`` (framework ops on T values)."""
    out = loss_rows
    if reduction != "none":
        out = loss_rows.sum()
        if reduction == "mean":
            out = out / count.reshape(())
    if dtype == "float32":
        return out
    if like.kind == "torch":
        return out.to(getattr(_module(like), dtype))
    return out.astype(_arrays._np_dtype(dtype))


def _concat(parts: list, like: DeviceArray):
    """The chunks' per-row losses in one array (an empty float32 one for no tokens)."""
    if not parts:
        return _arrays.empty(like, (0,), "float32").obj
    xp = _module(like)
    return xp.cat(parts) if like.kind == "torch" else xp.concatenate(parts)


def linear_cross_entropy(hidden, weight, target, bias=None, *, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                         softcap=None, reduction="mean", loss_dtype=None):
    """``cross_entropy(hidden @ weight.T + bias, target)`` without holding the (T, V) logits:
    chunks of tokens (``chunk_rows``) go through a matrix product and the loss kernel.

    Args:
        hidden: (*, H) float32, float16 or bfloat16 (bfloat16 needs torch tensors: CuPy has no
            bfloat16 matrix product).
        weight: (V, H), bias: (V,) or None, in hidden's dtype.
        target: (*) int32 or int64. Options and loss_dtype: as ``cross_entropy``.

    Returns:
        the loss as ``cross_entropy`` would give on the full logits.
    """
    opts = _options(ignore_index, label_smoothing, z_loss, softcap, reduction)
    ha, wa, ta, ba = _linear_inputs(hidden, weight, target, bias)
    out_dtype = _loss_dtype(loss_dtype, ha)
    h, w, t = ha.obj.reshape(-1, ha.shape[-1]), wa.obj, ta.obj.reshape(-1)
    n, v = t.shape[0], wa.shape[0]
    rows = []
    step = chunk_rows(n, v, ha.itemsize)
    bias = None if ba is None else ba.obj
    for s0 in range(0, n, step):
        rows.append(_chunk_forward(_chunk_logits(h[s0:s0 + step], w, bias), t[s0:s0 + step], opts))
    count = _count_valid(_arrays.wrap(t, "target"), v, opts).obj if reduction == "mean" else None
    out = _reduce_rows(_concat(rows, ha), count, reduction, ha, out_dtype)
    return out.reshape(ta.shape) if reduction == "none" else out


def linear_cross_entropy_forward_backward(hidden, weight, target, bias=None, *, ignore_index=-100,
                                          label_smoothing=0.0, z_loss=0.0, softcap=None, reduction="mean",
                                          loss_dtype=None):
    """The loss of ``linear_cross_entropy`` and its gradients for an upstream gradient of 1,
    chunk by chunk: each chunk's logits are made, turned into their gradient in place by the
    loss kernel, and multiplied back into dhidden (that chunk's rows) and dweight, dbias
    (accumulated). Extra memory: one chunk of logits (``CHUNK_BYTES``) and, for half
    precision, dweight's float32 accumulator (4·V·H bytes).

    dweight and dbias accumulate in float32 across chunks and are rounded once to the weight's
    dtype, as the one matrix product of the unchunked loss gives (Liger-Kernel rounds dweight
    a chunk). With torch tensors cuBLAS accumulates the chunks' products into float32 itself;
    with CuPy float16 arrays each chunk's product is rounded to float16 before it is added.
    reduction "mean" or "sum" (the gradient of "none" needs the upstream gradient of each row:
    use cross_entropy on the logits).

    Returns:
        (loss, dhidden (*, H), dweight (V, H), dbias (V,) or None).
    """
    opts = _options(ignore_index, label_smoothing, z_loss, softcap, reduction)
    loss, dh, dw, db = _linear_forward_backward(hidden, weight, target, bias, opts, loss_dtype, unrounded=False)
    return loss, dh, dw, db


def _linear_forward_backward(hidden, weight, target, bias, opts: Options, loss_dtype, unrounded: bool):
    """``linear_cross_entropy_forward_backward``; with ``unrounded`` its gradients stay float32
    (dhidden made by float32-output products, dweight and dbias their float32 accumulators), for
    a backward that applies the upstream gradient before rounding them once (``_scale_gradient``)."""
    if opts.reduction == "none":
        raise ValueError("reduction: the training form of linear_cross_entropy takes 'mean' or 'sum'")
    ha, wa, ta, ba = _linear_inputs(hidden, weight, target, bias)
    out_dtype = _loss_dtype(loss_dtype, ha)
    h, w, t = ha.obj.reshape(-1, ha.shape[-1]), wa.obj, ta.obj.reshape(-1)
    n, v = t.shape[0], wa.shape[0]
    count = _count_valid(_arrays.wrap(t, "target"), v, opts).obj if opts.reduction == "mean" else None
    dh = _arrays.empty(ha, (n, ha.shape[-1]), "float32" if unrounded else None).obj
    dw = _arrays.zeros(wa, wa.shape, "float32").obj
    db = _arrays.zeros(ha, (v,), "float32").obj if ba is not None else None
    rows = []
    step = chunk_rows(n, v, ha.itemsize)
    bias = None if ba is None else ba.obj
    for s0 in range(0, n, step):
        hc = h[s0:s0 + step]
        logits = _chunk_logits(hc, w, bias)
        rows.append(_chunk_train(logits, t[s0:s0 + step], count, opts))   # logits now hold dlogits
        _mm_into(dh[s0:s0 + step], logits, w)
        _addmm(dw, logits.T, hc)
        if db is not None:
            db += logits.sum(0, dtype=db.dtype)
        del logits   # (else the next chunk's logits are made while this one's are held: twice the memory)
    loss = _reduce_rows(_concat(rows, ha), count, opts.reduction, ha, out_dtype)
    if not unrounded:
        dw, db = (None if a is None else a.to(w.dtype) if hasattr(a, "to") else a.astype(w.dtype, copy=False)
                  for a in (dw, db))
    return loss, dh.reshape(ha.shape), dw, db


# ---- applying the upstream gradient (the PyTorch binding's backward) -------------------------

_SCALE = PlanCache()


def _scale_gradient(dloss, grad, dtype: str, donate: bool, configs: Configs = CONFIGS):
    """``grad`` (a gradient for an upstream gradient of 1, float32, contiguous) times the upstream
    gradient ``dloss`` (a scalar, or one value a row), rounded once to ``dtype``: into a new array,
    or with ``donate`` and ``dtype`` float32 over ``grad`` itself (rows whose upstream gradient is
    exactly 1 then cost nothing)."""
    arrays = [_arrays.as_device_array(dloss, "dloss"), _arrays.as_device_array(grad, "grad", ("float32",))]
    in_place = bool(donate) and dtype == "float32"
    key = (in_place, dtype, configs, *(a.key for a in arrays))
    plan = _SCALE.get(key) or _SCALE.put(key, _plan_scale(arrays, dtype, in_place, configs))
    bufs = plan(arrays)
    return bufs[1].obj if in_place else bufs[2].obj


def _plan_scale(arrays: list, dtype: str, in_place: bool, configs: Configs) -> Plan:
    da, ga = arrays
    device = _arrays.same_device(da, ga)
    v = ga.shape[-1] if ga.ndim else 1
    rows = ga.size // max(v, 1)
    if da.size not in (1, rows):
        raise ValueError(f"dloss: shape {da.shape} is neither a scalar nor one value a row of {ga.shape}")
    if not _arrays.is_contiguous(ga):
        raise ValueError(f"grad: must be contiguous (the training form's output), got strides {ga.strides}")
    if da.dtype not in ("float32", dtype):
        raise ValueError(f"dloss: dtype {da.dtype} is neither float32 nor the gradient's {dtype}")
    b = Builder(arrays)
    if not _arrays.is_contiguous(da):
        b.fix(0, DeviceArray.contiguous)
    out = b.slot(1) if in_place else b.alloc(ga.shape, dtype)
    if in_place:
        b.absent()
    if rows and v:
        vec = 4 if v % 4 == 0 and ga.ptr % 16 == 0 else 1
        k = _kernels.kernel(configs.scale("float32", dtype, da.dtype, vec), device)
        b.launch(k, min(rows, k.resident_blocks()), src=b.slot(1), dst=out, rows=rows, V=v, stride=v,
                 dloss=b.slot(0), dloss_stride=int(da.size == rows and rows > 1))
    return b.plan(device, first=1)


# ---- NumPy references ------------------------------------------------------------------------

def _reference_rows(logits, target, opts: Options):
    la = _arrays.as_host_array(logits, "logits")
    ta = _arrays.as_host_array(target, "target", tuple(INDEX_CTYPES))
    _check_rows(la, ta)
    v = la.shape[-1]
    x = la.obj.astype(np.float64).reshape(-1, v)
    t = ta.obj.astype(np.int64).reshape(-1)
    bad = (t != opts.ignore_index) & ((t < 0) | (t >= v))
    if bad.any():
        value = int(t[bad][0])
        raise IndexError(f"target: class {value} is out of range for {v} classes (valid: 0 to {v - 1}, "
                         "or ignore_index)")
    z = opts.softcap * np.tanh(x / opts.softcap) if opts.softcap else x
    with np.errstate(all="ignore"):
        m = np.max(z, axis=1, keepdims=True)
        m = np.where(np.isfinite(m), m, 0.0)
        lse = (np.log(np.sum(np.exp(z - m), axis=1, keepdims=True)) + m)[:, 0]
    keep = t != opts.ignore_index
    return la, ta, x, z, t, lse, keep


def _reference_loss_rows(z, t, lse, keep, opts: Options, v: int):
    zt = np.where(keep, z[np.arange(len(t)), np.where(keep, t, 0)], 0.0)
    with np.errstate(all="ignore"):
        loss = lse - (1.0 - opts.smoothing) * zt + opts.z_loss * lse * lse
        if opts.smoothing:
            loss = loss - opts.smoothing / v * np.sum(z, axis=1)
    return np.where(keep, loss, 0.0)


def reference_cross_entropy(logits, target, *, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None,
                            reduction="mean", return_lse=False, loss_dtype=None):
    """``cross_entropy`` in float64 (an out-of-range target raises IndexError at once)."""
    opts = _options(ignore_index, label_smoothing, z_loss, softcap, reduction)
    la, ta, x, z, t, lse, keep = _reference_rows(logits, target, opts)
    if la.dtype != "float64":
        _loss_dtype(loss_dtype, la)
    rows = _reference_loss_rows(z, t, lse, keep, opts, la.shape[-1])
    with np.errstate(all="ignore"):
        if reduction == "none":
            loss = rows.reshape(ta.shape)
        elif reduction == "sum":
            loss = np.float64(rows.sum())
        else:
            loss = np.float64(rows.sum() / keep.sum())
    return (loss, lse.reshape(ta.shape)) if return_lse else loss


def reference_cross_entropy_backward(dloss, logits, target, lse, *, ignore_index=-100, label_smoothing=0.0,
                                     z_loss=0.0, softcap=None, reduction="mean"):
    """``cross_entropy_backward`` in float64 (``lse`` is checked, then recomputed)."""
    opts = _options(ignore_index, label_smoothing, z_loss, softcap, reduction)
    la, ta, x, z, t, lse_, keep = _reference_rows(logits, target, opts)
    v = la.shape[-1]
    da = _arrays.as_host_array(dloss, "dloss")
    if da.dtype != "float64":
        _check_dloss(da, la, _loss_shape(ta, reduction))
    elif da.shape != _loss_shape(ta, reduction):
        raise ValueError(f"dloss: shape {da.shape} does not match the loss's {_loss_shape(ta, reduction)}")
    _check_backward(_arrays.as_host_array(lse, "lse", ("float32",)), ta)
    g = np.broadcast_to(da.obj.astype(np.float64).reshape(-1), (len(t),)).copy()
    if reduction == "mean":
        g = g / keep.sum()
    with np.errstate(all="ignore"):
        p = np.exp(z - lse_[:, None])
        dz = p * (1.0 + 2.0 * opts.z_loss * lse_[:, None]) - opts.smoothing / v
        idx = np.nonzero(keep)[0]
        dz[idx, t[idx]] -= 1.0 - opts.smoothing
        if opts.softcap:
            dz = dz * (1.0 - (z / opts.softcap) ** 2)
        dx = np.where(keep[:, None], g[:, None] * dz, 0.0)
    return dx.reshape(la.shape)


def reference_cross_entropy_forward_backward(logits, target, *, ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                                             softcap=None, reduction="mean", inplace=False, return_lse=False,
                                             loss_dtype=None):
    """``cross_entropy_forward_backward`` in float64 (``inplace`` is accepted and ignored)."""
    kw = dict(ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
              reduction=reduction)
    loss, lse = reference_cross_entropy(logits, target, return_lse=True, loss_dtype=loss_dtype, **kw)
    one = np.ones(np.shape(loss))
    d = reference_cross_entropy_backward(one, logits, target, lse.astype(np.float32), **kw)
    return (loss, d, lse) if return_lse else (loss, d)


def _reference_linear(hidden, weight, target, bias):
    ha, wa = _arrays.as_host_array(hidden, "hidden"), _arrays.as_host_array(weight, "weight")
    ta = _arrays.as_host_array(target, "target", tuple(INDEX_CTYPES))
    ba = None if bias is None else _arrays.as_host_array(bias, "bias")
    _check_linear(ha, wa, ta, ba)
    h = ha.obj.astype(np.float64).reshape(-1, ha.shape[-1])
    w = wa.obj.astype(np.float64)
    logits = h @ w.T + (0.0 if ba is None else ba.obj.astype(np.float64))
    return ha, ta, h, w, logits


def reference_linear_cross_entropy(hidden, weight, target, bias=None, *, ignore_index=-100, label_smoothing=0.0,
                                   z_loss=0.0, softcap=None, reduction="mean", loss_dtype=None):
    """``linear_cross_entropy`` in float64: the loss of the full logits."""
    ha, ta, h, w, logits = _reference_linear(hidden, weight, target, bias)
    if ha.dtype != "float64":
        _loss_dtype(loss_dtype, ha)
    loss = reference_cross_entropy(logits, ta.obj.reshape(-1), ignore_index=ignore_index,
                                   label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap, reduction=reduction)
    return loss.reshape(ta.shape) if reduction == "none" else loss


def reference_linear_cross_entropy_forward_backward(hidden, weight, target, bias=None, *, ignore_index=-100,
                                                    label_smoothing=0.0, z_loss=0.0, softcap=None, reduction="mean",
                                                    loss_dtype=None):
    """``linear_cross_entropy_forward_backward`` in float64: (loss, dhidden, dweight, dbias)."""
    if reduction == "none":
        raise ValueError("reduction: the training form of linear_cross_entropy takes 'mean' or 'sum'")
    ha, ta, h, w, logits = _reference_linear(hidden, weight, target, bias)
    kw = dict(ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
              reduction=reduction)
    loss, d = reference_cross_entropy_forward_backward(logits, ta.obj.reshape(-1), **kw)
    return loss, (d @ w).reshape(ha.shape), d.T @ h, (None if bias is None else d.sum(0))


# ---- benchmark cases ----------------------------------------------------------------------------

# (tokens, vocabulary): LLaMA-3's vocabulary, a batch of 8 x 2048 tokens.
WORKLOAD = {"full": (16384, 128256), "quick": (4096, 32000), "dtype": "bfloat16"}


def _inputs(T, V, dtype, seed, *, grad=False) -> dict:
    import torch

    gen = generator(seed)
    t = {"x": randn((T, V), dtype, gen) * 4, "target": torch.randint(0, V, (T,), device="cuda", generator=gen)}
    t["target"][::97] = -100   # a few ignored rows, as padding gives
    if grad:
        t["dy"] = torch.ones((), device="cuda", dtype=t["x"].dtype)
        t["leaves"] = (t["x"].detach().requires_grad_(True),)
    return t


def _fwd(t):
    return cross_entropy(t["x"], t["target"])


def _torch_fwd(t):
    import torch.nn.functional as F

    return F.cross_entropy(t["x"], t["target"])


def _train(t):
    return cross_entropy_forward_backward(t["x"], t["target"])


def _torch_train(t, upcast=False):
    import torch
    import torch.nn.functional as F

    x = t["leaves"][0]
    loss = F.cross_entropy(x.float() if upcast else x, t["target"])
    return loss.detach().to(x.dtype), *torch.autograd.grad(loss, t["leaves"])


def _forward_on(F, t):
    if F is None:
        import torch.nn.functional as F
    return F.cross_entropy(t["leaves"][0], t["target"])


def bench_cases(quick: bool) -> list:
    """T rows of V logits. fwd: read the logits (2·T·V bytes in bf16); fwd+bwd (the training
    form): read the logits, write the gradient (4·T·V): the byte floor of a fused loss."""
    (T, V), dt = WORKLOAD["quick" if quick else "full"], WORKLOAD["dtype"]
    (lt, lv, lh), ldt = LINEAR_WORKLOAD["quick" if quick else "full"], LINEAR_WORKLOAD["dtype"]
    make = functools.partial(_inputs, T, V, dt)
    one, two = elements_bytes((T, V), dt), elements_bytes((T, V), dt, 2)
    return [
        Case("cross_entropy fwd", "cross_entropy", (T, V), dt, one, make, _fwd, _torch_fwd),
        Case("cross_entropy fwd+bwd", "cross_entropy", (T, V), dt, two, functools.partial(make, grad=True),
                    _train, _torch_train),
        Case("cross_entropy fwd+bwd vs fp32 upcast", "cross_entropy", (T, V), dt, two,
                    functools.partial(make, grad=True), _train, functools.partial(_torch_train, upcast=True)),
        Case("linear_cross_entropy fwd+bwd", "cross_entropy", (lt, lv, lh), ldt,
                    elements_bytes((lt, lv), ldt, 2), functools.partial(_linear_bench_inputs, lt, lv, lh, ldt),
                    _linear_train, _linear_torch_train, flops=6 * lt * lv * lh),
    ]


def _liger(t):
    from liger_kernel.transformers.functional import liger_cross_entropy

    return liger_cross_entropy(t["leaves"][0], t["target"])


# (tokens, vocabulary, hidden size) of the linear cross-entropy: LLaMA-3-8B's head
LINEAR_WORKLOAD = {"full": (16384, 128256, 4096), "quick": (4096, 32000, 1024), "dtype": "bfloat16"}


def _linear_bench_inputs(T, V, H, dtype, seed) -> dict:
    import torch

    gen = generator(seed)
    t = {"h": randn((T, H), dtype, gen), "w": randn((V, H), dtype, gen) * 0.02,
         "target": torch.randint(0, V, (T,), device="cuda", generator=gen)}
    t["leaves"] = (t["h"].detach().requires_grad_(True), t["w"].detach().requires_grad_(True))
    t["dy"] = torch.ones((), device="cuda", dtype=t["h"].dtype)
    return t


def _linear_train(t):
    return linear_cross_entropy_forward_backward(t["h"], t["w"], t["target"])[:3]


def _linear_forward_on(F, t):
    h, w = t["leaves"]
    if F is not None and hasattr(F, "linear_cross_entropy"):
        return F.linear_cross_entropy(h, w, t["target"])
    import torch.nn.functional as TF

    return TF.cross_entropy(TF.linear(h, w), t["target"])


def _linear_torch_train(t):
    import torch

    loss = _linear_forward_on(None, t)
    return (loss.detach(), *torch.autograd.grad(loss, t["leaves"]))


def _linear_liger(t):
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    h, w = t["leaves"]
    return liger_fused_linear_cross_entropy(h, w, t["target"])


def torch_bench_cases(quick: bool) -> list:
    (T, V), dt = WORKLOAD["quick" if quick else "full"], WORKLOAD["dtype"]
    (lt, lv, lh), ldt = LINEAR_WORKLOAD["quick" if quick else "full"], LINEAR_WORKLOAD["dtype"]
    return [TorchCase("cross_entropy fwd+bwd", "cross_entropy", (T, V), dt,
                             elements_bytes((T, V), dt, 2), functools.partial(_inputs, T, V, dt, grad=True),
                             _forward_on, _train, liger=_liger),
            TorchCase("linear_cross_entropy fwd+bwd", "cross_entropy", (lt, lv, lh), ldt,
                             elements_bytes((lt, lv), ldt, 2),
                             functools.partial(_linear_bench_inputs, lt, lv, lh, ldt), _linear_forward_on,
                             _linear_train, liger=_linear_liger, flops=6 * lt * lv * lh)]


# ---- PyTorch bindings -------------------------------------------------------------------------

def _fake(logits, target, ignore_index, smoothing, z_loss, softcap, reduction, float32_loss):
    import torch

    dtype = torch.float32 if float32_loss else logits.dtype
    loss = logits.new_empty(target.shape if reduction == "none" else (), dtype=dtype)
    return (loss, torch.empty_like(logits, memory_format=torch.contiguous_format),
            logits.new_empty(target.shape, dtype=torch.float32))


def _kwargs(ignore_index, smoothing, z_loss, softcap, reduction, float32_loss) -> dict:
    return dict(ignore_index=ignore_index, label_smoothing=smoothing, z_loss=z_loss,
                softcap=softcap if softcap > 0 else None, reduction=reduction,
                loss_dtype="float32" if float32_loss else None)


def _ce_backward(dloss, unit, logits, target, lse, ignore_index, smoothing, z_loss, softcap, reduction,
                 donate: bool):
    opts = _options(ignore_index, smoothing, z_loss, softcap, reduction)
    return (_backward(dloss, logits, target, lse, unit, opts, donate),)


TORCH_OPS = (
    # The forward is the training form: the loss and, for an upstream gradient of 1, its
    # gradient, kept with the logits and lse for the backward. There, rows whose upstream
    # gradient is exactly 1 take the kept gradient (eager, with the graph not retained: as it
    # is, no work at all); others are computed again from the logits, so that the upstream
    # gradient is applied before the one rounding, as PyTorch's own loss does.
    TorchOp("cross_entropy",
            "(Tensor logits, Tensor target, int ignore_index, float label_smoothing, float z_loss, "
            "float softcap, str reduction, bool float32_loss) -> (Tensor, Tensor, Tensor)",
            forward=lambda x, t, *o: cross_entropy_forward_backward(x, t, return_lse=True, **_kwargs(*o)),
            inference=lambda x, t, *o: cross_entropy(x, t, **_kwargs(*o)),
            fake=_fake,
            save=lambda inputs, outputs: ((outputs[1], inputs[0], inputs[1], outputs[2]), tuple(inputs[2:7])),
            backward_schema="(Tensor dloss, Tensor unit, Tensor logits, Tensor target, Tensor lse, int ignore_index, "
                            "float label_smoothing, float z_loss, float softcap, str reduction) -> Tensor",
            backward=lambda *a: _ce_backward(*a, donate=False),
            donating_backward=lambda *a: _ce_backward(*a, donate=True),
            backward_fake=lambda dloss, unit, *a: (unit.new_empty(unit.shape),),
            backward_args=lambda saved, state, grads, T: (grads[0], *saved, *state),
            grads_to=(0,), native=True),
)


def _lce_forward(h, w, t, b, opts):
    kw = _kwargs(*opts)
    loss_dtype = kw.pop("loss_dtype")
    opts = _options(kw["ignore_index"], kw["label_smoothing"], kw["z_loss"], kw["softcap"], kw["reduction"])
    loss, dh, dw, db = _linear_forward_backward(h, w, t, b, opts, loss_dtype, unrounded=True)
    return loss, dh, dw, (h.new_empty((0,), dtype=dw.dtype) if db is None else db)


def _lce_fake(h, w, t, b, ignore_index, smoothing, z_loss, softcap, reduction, float32_loss):
    import torch

    f32 = torch.float32
    loss = h.new_empty((), dtype=f32 if float32_loss else h.dtype)
    return (loss, h.new_empty(h.shape, dtype=f32), w.new_empty(w.shape, dtype=f32),
            h.new_empty((w.shape[0],) if b is not None else (0,), dtype=f32))


def _lce_scale(dloss, dh, dw, db, dtype, donate: bool):
    """The gradients kept in float32 for an upstream gradient of 1 times the real one, each
    rounded once to the inputs' ``dtype`` (a torch dtype)."""
    dt = str(dtype).removeprefix("torch.")
    out = tuple(_scale_gradient(dloss, g, dt, donate) for g in (dh, dw))
    return out + ((_scale_gradient(dloss, db, dt, donate) if db.numel() else None),)


TORCH_OPS += (
    # Like the cross-entropy's: the forward computes the loss and every gradient for an upstream
    # gradient of 1 (the logits never exist whole), kept unrounded in float32; the backward
    # applies the real one and rounds each once.
    TorchOp("linear_cross_entropy",
            "(Tensor hidden, Tensor weight, Tensor target, Tensor? bias, int ignore_index, float label_smoothing, "
            "float z_loss, float softcap, str reduction, bool float32_loss) -> (Tensor, Tensor, Tensor, Tensor)",
            forward=lambda h, w, t, b, *o: _lce_forward(h, w, t, b, o),
            inference=lambda h, w, t, b, *o: linear_cross_entropy(h, w, t, b, **_kwargs(*o)),
            fake=_lce_fake,
            save=lambda inputs, outputs: (tuple(outputs[1:4]), inputs[0].dtype),
            backward_schema="(Tensor dloss, Tensor dhidden, Tensor dweight, Tensor dbias, ScalarType dtype) "
                            "-> (Tensor, Tensor, Tensor)",
            backward=lambda dl, dh, dw, db, dt: _lce_scale(dl, dh, dw, db, dt, donate=False),
            donating_backward=lambda dl, dh, dw, db, dt: _lce_scale(dl, dh, dw, db, dt, donate=True),
            backward_fake=lambda dl, dh, dw, db, dt: tuple(g.new_empty(g.shape, dtype=dt) for g in (dh, dw, db)),
            backward_args=lambda saved, state, grads, T: (grads[0], *saved, state),
            grads_to=(0, 1, 3)),
)


def _torch_fallback(hidden, weight, target, bias, ignore_index, label_smoothing, z_loss, softcap, reduction):
    """PyTorch's own ops for what the kernels do not take (CPU tensors): the same loss."""
    import torch
    import torch.nn.functional as F

    z = F.linear(hidden, weight, bias).float()
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    z, t = z.reshape(-1, z.shape[-1]), target.reshape(-1)
    loss = F.cross_entropy(z, t, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction=reduction)
    if z_loss:
        keep = (t != ignore_index).float()
        zl = z_loss * torch.logsumexp(z, dim=-1) ** 2 * keep
        loss = loss + {"none": zl, "sum": zl.sum(), "mean": zl.sum() / keep.sum()}[reduction]
    return loss.reshape(target.shape) if reduction == "none" else loss


def _torch_api(T, ops, modules) -> dict:
    """``cukern.torch.linear_cross_entropy`` and ``cukern.torch.LinearCrossEntropyLoss``."""
    import torch
    from torch import nn

    op = ops["linear_cross_entropy"]

    def linear_cross_entropy(hidden, weight, target, bias=None, *, ignore_index=-100, label_smoothing=0.0,
                             z_loss=0.0, softcap=None, reduction="mean"):
        """``F.cross_entropy(F.linear(hidden, weight, bias), target)`` for an LM head, without the
        (tokens, vocabulary) logits: autograd (dhidden, dweight, dbias) and torch.compile.

        hidden (*, H), weight (V, H), bias (V,) or None; target (*) int64/int32. Under CUDA
        autocast the matrix products run in the autocast dtype and the loss is float32, as
        F.linear followed by F.cross_entropy give. reduction "mean" or "sum" with autograd, also
        "none" without. z_loss and softcap as cukern.cross_entropy. Tensors that are not on a
        GPU run PyTorch's ops."""
        if not (hidden.is_cuda and weight.is_cuda and target.is_cuda):
            return _torch_fallback(hidden, weight, target, bias, ignore_index, label_smoothing, z_loss, softcap,
                                   reduction)
        f32 = False
        if torch.is_autocast_enabled("cuda"):
            dt = torch.get_autocast_dtype("cuda")
            hidden, weight, bias = T.cast(hidden, dt), T.cast(weight, dt), T.cast(bias, dt)
            f32 = True
        args = (hidden, weight, target, bias, int(ignore_index), float(label_smoothing), float(z_loss),
                float(softcap or 0.0), reduction, f32)
        return op.compiled(*args) if T.compiling() else op(*args)

    class LinearCrossEntropyLoss(nn.Module):
        """The loss of an LM head: ``forward(hidden, weight, target, bias=None)`` is
        ``linear_cross_entropy`` with the options given here (Liger's fused linear cross-entropy
        loss takes the same inputs)."""

        def __init__(self, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None, reduction="mean"):
            super().__init__()
            self.ignore_index, self.label_smoothing, self.z_loss = ignore_index, label_smoothing, z_loss
            self.softcap, self.reduction = softcap, reduction

        def forward(self, hidden, weight, target, bias=None):
            return linear_cross_entropy(hidden, weight, target, bias, ignore_index=self.ignore_index,
                                        label_smoothing=self.label_smoothing, z_loss=self.z_loss,
                                        softcap=self.softcap, reduction=self.reduction)

    LinearCrossEntropyLoss.__module__ = "cukern.torch"
    return {"linear_cross_entropy": linear_cross_entropy, "LinearCrossEntropyLoss": LinearCrossEntropyLoss}


def _route(T, input, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean",
           label_smoothing=0.0):
    """(N, C) logits of a float dtype with (N,) integer class targets; no class weights, no
    probability targets, no legacy size_average/reduce. Under autocast, which computes the
    loss of half-precision logits in float32, the kernels read the half logits as they are
    (they compute in float32) and return a float32 loss: no float32 copy of the logits."""
    x = input
    if not (x.is_cuda and target.is_cuda and x.device == target.device):
        return "not CUDA tensors on one device"
    if weight is not None or size_average is not None or reduce is not None:
        return "class weights or legacy reduction arguments"
    if x.dim() != 2 or target.dim() != 1 or target.shape[0] != x.shape[0]:
        return "not (N, C) logits with (N,) class targets"
    if target.dtype not in T.INDEX_DTYPES:
        return "probability targets or target dtype"
    if x.dtype not in T.FLOAT_DTYPES:
        return f"dtype {x.dtype}"
    if reduction not in REDUCTIONS or not 0.0 <= label_smoothing <= 1.0 or x.shape[1] == 0:
        return "reduction, label_smoothing or classes"
    if T.small("cross_entropy", x.numel()):
        return T.SMALL
    dt = T.autocast_dtype("cross_entropy", x.dtype)
    float32_loss = dt == T.torch.float32 and x.dtype != dt
    if dt != x.dtype and not float32_loss:
        x = T.cast(x, dt)
    return "cross_entropy", (x, target, int(ignore_index), float(label_smoothing), 0.0, 0.0, reduction,
                             float32_loss), None


def _probe(f, x):
    import torch

    return f(x.reshape(-1, 8), torch.zeros((x.numel() // 8,), dtype=torch.long, device=x.device))


FAMILY = Family(
    name="cross_entropy",
    api=(cross_entropy, cross_entropy_backward, cross_entropy_forward_backward, linear_cross_entropy,
         linear_cross_entropy_forward_backward),
    references={"cross_entropy": reference_cross_entropy,
                "cross_entropy_backward": reference_cross_entropy_backward,
                "cross_entropy_forward_backward": reference_cross_entropy_forward_backward,
                "linear_cross_entropy": reference_linear_cross_entropy,
                "linear_cross_entropy_forward_backward": reference_linear_cross_entropy_forward_backward},
    instances=instances,
    bench=bench_cases,
    torch_bench=torch_bench_cases,
    torch_ops=TORCH_OPS,
    dropins=(DropIn("cross_entropy", _route, compile=False, probe=_probe, min_size=2**20),),   # (logit elements)
    torch_api=_torch_api,
)
