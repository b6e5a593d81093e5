"""Linear cross-entropy: the LM head and the loss without the (T, V) logits, chunk by chunk."""
from __future__ import annotations

from .. import _arrays, _checks, _kernels
from .._arrays import DeviceArray
from .._plans import Builder, Plan, PlanCache
from . import configs as _cfg
from .checks import Flags, Options, _options, _target
from .configs import FORWARD, TRAIN, Configs
from .loss import _loss_dtype, _run

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


def _count_valid(ta: DeviceArray, v: int, opts: Options, configs: Configs = _cfg.CONFIGS):
    """(1,) float32 on the device: the targets that are neither ignore_index nor out of range."""
    plan = _COUNT.plan((v, opts.ignore_index, configs, ta.key), _plan_count, ta, v, opts, configs)
    return plan([ta])[1]


def _plan_count(ta: DeviceArray, v: int, opts: Options, configs: Configs) -> Plan:
    b = Builder([ta])
    count = b.alloc((1,), "float32")
    if ta.size:
        k = _kernels.kernel(configs.count(ta.dtype), ta.device)
        b.launch(k, 1, target=b.slot(0), rows=ta.size, V=v, ignore_index=opts.ignore_index, count=count)
    else:
        b.fill(0.0, count)
    return b.plan(ta.device)


def _chunk_train(logits, target, count, opts: Options):
    """The training form on one chunk of logits, in place: the chunk's per-row float32 losses;
    the gradient, written over the logits, is scaled by 1 / ``count`` (for "mean") — the kept
    rows of the whole batch, not the chunk's."""
    arrays = [_arrays.as_device_array(logits, "logits"), _target(target),
              _arrays.as_device_array(count, "count", ("float32",)) if count is not None else None]
    chunk_opts = Options(opts.ignore_index, opts.smoothing, opts.z_loss, opts.softcap, "none")
    if count is None:
        arrays.pop()
    flags = Flags(inplace=True, shared_count=count is not None)
    return _run(TRAIN, arrays, chunk_opts, flags, _cfg.CONFIGS)("loss")


def _chunk_forward(logits, target, opts: Options):
    arrays = [_arrays.as_device_array(logits, "logits"), _target(target)]
    chunk_opts = Options(opts.ignore_index, opts.smoothing, opts.z_loss, opts.softcap, "none")
    return _run(FORWARD, arrays, chunk_opts, Flags(), _cfg.CONFIGS)("loss")


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
