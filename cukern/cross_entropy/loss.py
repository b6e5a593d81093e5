"""``cross_entropy``, ``cross_entropy_forward_backward`` and ``cross_entropy_backward``: the row
kernel's fronts and their launch plans."""
from __future__ import annotations

import math

from .. import _arrays, _faults, _kernels
from .._arrays import DeviceArray
from .._plans import Builder, Plan, PlanCache
from . import configs as _cfg
from .checks import (Flags, Options, _check_backward, _check_rows, _loss_shape, _options, _rows_layout, _target,
                     _vector_width)
from .configs import BACKWARD, FORWARD, TRAIN, Configs

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
    flags = Flags(return_lse=bool(return_lse), loss_dtype=_loss_dtype(loss_dtype, arrays[0]))
    out = _run(FORWARD, arrays, opts, flags, _cfg.CONFIGS)
    return (out("loss"), out("lse")) if return_lse else out("loss")


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
    flags = Flags(return_lse=bool(return_lse), inplace=bool(inplace), loss_dtype=_loss_dtype(loss_dtype, arrays[0]))
    out = _run(TRAIN, arrays, opts, flags, _cfg.CONFIGS)
    return (out("loss"), out("dlogits"), out("lse")) if return_lse else (out("loss"), out("dlogits"))


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
    return _run(BACKWARD, arrays, opts, Flags(donate=bool(donate)), _cfg.CONFIGS)("dlogits")


def _run(mode: int, arrays: list, opts: Options, flags: Flags, configs: Configs):
    """Run the call; its outputs, by name: ``out("loss")``, ``out("lse")``, ``out("dlogits")``."""
    key = (mode, opts, flags, configs, *(a.key for a in arrays))
    plan = _PLANS.plan(key, _plan, mode, arrays, opts, flags, configs)
    bufs = plan(arrays)
    return lambda name: plan.out(bufs, name)


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


def _plan(mode: int, arrays: list, opts: Options, flags: Flags, configs: Configs) -> Plan:
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
    if mode == TRAIN and flags.inplace and la.row_stride() is None:
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
        if flags.donate:   # written over the training form's gradient
            dlogits, d_stride = b.output("dlogits", unit), v
            b.absent()
        else:
            dlogits, d_stride = b.alloc(la.shape, la.dtype, name="dlogits"), v
        dloss, lse = b.slot(2), b.slot(3)
    else:
        return_lse, inplace, loss_dtype = flags.return_lse, flags.inplace, flags.loss_dtype
        # "none" in float32: the kernel's per-row losses are the output
        loss = b.alloc(_loss_shape(ta, opts.reduction), loss_dtype, name="loss")
        if none and loss_dtype == "float32":
            loss_rows = loss
        lse = b.alloc(ta.shape, "float32", name="lse") if return_lse else b.absent("lse")
        dlogits = None
        if mode == TRAIN and inplace:
            dlogits, d_stride = b.output("dlogits", b.slot(0)), stride
        if mode == TRAIN and not inplace:
            dlogits, d_stride = b.alloc(la.shape, la.dtype, name="dlogits"), v
        else:
            b.absent()
        if loss_rows is None and rows:
            loss_rows = b.alloc((rows,), "float32")
    # a count given (the linear cross-entropy's chunks: per-row losses, the gradient scaled by the
    # rows kept in the whole batch) or, for "mean", counted here
    shared = mode == TRAIN and flags.shared_count
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
        k = _kernels.kernel(configs.reduce(flags.loss_dtype), device)
        b.launch(k, 1, loss_rows=loss_rows, rows=rows, count=count, out=loss)
    elif mode != BACKWARD and loss_rows is not loss:
        k = _kernels.kernel(configs.cast(flags.loss_dtype), device)
        b.launch(k, min(-(-rows // 256), 4 * _kernels.sm_count(device)), src=loss_rows, n=rows, dst=loss)
    return b.plan(device)
