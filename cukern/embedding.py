"""Embedding lookup and its dense, deterministic weight gradient (kernels: cuda_src/embedding.cu).

Shapes: ``indices`` any shape (*), int32 or int64; ``weight`` (V, D); outputs (*, D).
dtypes: float32, float16, bfloat16 for weight and grad; accumulation in float32.
Out-of-range indices never touch memory out of bounds: they are recorded on the device and
raised as ``IndexError`` by ``cukern.check_errors()`` (or at once with ``check=True``).
"""
from __future__ import annotations

import operator

import numpy as np

from . import _arrays, _faults, _kernels

__all__ = ["embedding", "embedding_backward"]

SOURCE = "embedding.cu"
INDEX_CTYPES = {"int32": "int", "int64": "long long"}
FWD_THREADS = 512  # 128 measured 4x slower at D = 4096 (tools/tune_embedding.py)
# Rows of at most this many bytes go a warp a token (embedding_fwd_warp): measured faster up
# to D = 2048 bf16 and slower at 4096 (tools/experiment_embedding_warpsort.py).
WARP_ROW_BYTES = 4096
WARP_THREADS = 256
CHUNK = 64           # sorted entries a block of the backward sums
BWD_THREADS, BWD_NV = 128, 4   # column tile: BWD_THREADS * BWD_NV vectors
COMBINE_THREADS = 128


def instances() -> list[str]:
    """Every kernel instance the fronts below can launch (for the compile check)."""
    names = []
    for ctype, itemsize in _arrays.DTYPES.values():
        for vec in sorted({1, 16 // itemsize}):
            names += [f"embedding_fwd<{ctype}, {ic}, {vec}, {FWD_THREADS}>" for ic in INDEX_CTYPES.values()]
            names += [f"embedding_fwd_warp<{ctype}, {ic}, {vec}, {WARP_THREADS}>" for ic in INDEX_CTYPES.values()]
            names.append(f"embedding_bwd_chunks<{ctype}, {vec}, {BWD_NV}, {BWD_THREADS}>")
            names.append(f"embedding_bwd_zero<{ctype}, {vec}, {FWD_THREADS}>")
        names.append(f"embedding_bwd_combine<{ctype}, {COMBINE_THREADS}>")
    names += [f"embedding_bwd_keys<{ic}>" for ic in INDEX_CTYPES.values()]
    return names


def _vec(itemsize: int, D: int, *arrays) -> int:
    vec = 16 // itemsize
    if D % vec or any(a.ptr % 16 for a in arrays):
        return 1
    return vec


def _check_indices(indices):
    return _arrays.as_device_array(indices, "indices", dtypes=tuple(INDEX_CTYPES)).contiguous()


def _validate_now(ia, V: int) -> None:
    """check=True: find the first out-of-range index now (one host synchronization)."""
    if ia.size == 0:
        return
    c = _arrays.as_cupy(ia)
    with _arrays.launch_context(ia):
        bad = (c < 0) | (c >= V)
        if bool(bad.any()):
            value = int(c.ravel()[int(bad.ravel().argmax())])
            raise IndexError(f"indices: index {value} is out of range for {V} embeddings "
                             f"(valid: 0 to {V - 1})")


def _padding(padding_idx, V: int) -> int:
    """torch's rule: -V <= padding_idx < V; negative counts from the end. -1 for none."""
    if padding_idx is None:
        return -1
    try:
        p = operator.index(padding_idx)
    except TypeError:
        raise TypeError(f"padding_idx: expected an int or None, got {type(padding_idx).__name__}") from None
    if not -V <= p < V:
        raise ValueError(f"padding_idx: {p} is out of range for {V} embeddings (need -{V} <= padding_idx < {V})")
    return p % V


def embedding(indices, weight, padding_idx=None, *, check=False):
    """Rows of ``weight`` picked by ``indices``: ``weight[indices]``.

    Args:
        indices: (*) int32 or int64 (CuPy array or torch CUDA tensor).
        weight: (V, D) float32, float16 or bfloat16, on the same device.
        padding_idx: as in ``torch.nn.functional.embedding`` (checked here; it matters to
            the backward only).
        check: validate the indices first (one host sync) and raise ``IndexError`` at once.
            Without it, an out-of-range index gives a zero row and is reported by the next
            ``cukern.check_errors()``.

    Returns:
        (*, D) of weight's dtype, the same array type as ``weight``.
    """
    ia = _check_indices(indices)
    wa = _arrays.as_device_array(weight, "weight")
    if wa.ndim != 2:
        raise ValueError(f"weight: must be 2-D (num_embeddings, embedding_dim), got shape {wa.shape}")
    device = _arrays.same_device(ia, wa)
    V, D = wa.shape
    _padding(padding_idx, V)
    wa = wa.contiguous()
    out = _arrays.empty(wa, ia.shape + (D,))
    ntok = ia.size
    if check:
        _validate_now(ia, V)
    if ntok and D:
        vec = _vec(wa.itemsize, D, wa, out)
        ic = INDEX_CTYPES[ia.dtype]
        if D * wa.itemsize <= WARP_ROW_BYTES:
            fn = _kernels.function(SOURCE, f"embedding_fwd_warp<{wa.ctype}, {ic}, {vec}, {WARP_THREADS}>", device)
            threads, per_block = WARP_THREADS, WARP_THREADS // 32
        else:
            fn = _kernels.function(SOURCE, f"embedding_fwd<{wa.ctype}, {ic}, {vec}, {FWD_THREADS}>", device)
            threads, per_block = FWD_THREADS, 1
        rec = _faults.record(device)
        with _arrays.launch_context(wa):
            grid = min(-(-ntok // per_block), _kernels.resident_blocks(fn, threads, device))
            _kernels.launch(fn, grid, threads, (ia, np.int64(ntok), wa, np.int64(V), np.int32(D),
                                                   out, np.uint64(rec.data.ptr)))
    return out.obj


def embedding_backward(grad, indices, num_embeddings, padding_idx=None, scale_grad_by_freq=False, *,
                       check=False):
    """Dense gradient of ``embedding`` with respect to the weight.

    Args:
        grad: (*, D) float32, float16 or bfloat16: the gradient of the output.
        indices: (*) int32 or int64, as given to the forward.
        num_embeddings: V.
        padding_idx: that row gets no gradient (negative counts from the end, as in torch).
        scale_grad_by_freq: divide each index's gradient by the number of its occurrences.
        check: validate the indices first (see ``embedding``).

    Returns:
        (V, D) of grad's dtype: per index the float32 sum of its grad rows, rounded once;
        rows never looked up are zero. Bitwise deterministic (sorted, fixed-order sums).
    """
    ga = _arrays.as_device_array(grad, "grad")
    ia = _check_indices(indices)
    try:
        V = operator.index(num_embeddings)
    except TypeError:
        raise TypeError(f"num_embeddings: expected an int, got {type(num_embeddings).__name__}") from None
    if V < 1:
        raise ValueError(f"num_embeddings: must be at least 1, got {V}")
    if ga.ndim < 1 or ga.shape[:-1] != ia.shape:
        raise ValueError(f"grad: shape {ga.shape} does not match indices' shape {ia.shape} + (embedding_dim,)")
    device = _arrays.same_device(ga, ia)
    pad = _padding(padding_idx, V)
    D = ga.shape[-1]
    ga = ga.contiguous()
    ntok = ia.size
    if check:
        _validate_now(ia, V)
    if not (ntok and D):
        return _arrays.zeros(ga, (V, D)).obj
    dw = _arrays.empty(ga, (V, D))
    if ntok >= 2**32:
        raise ValueError(f"indices: {ntok} tokens; at most 2**32 - 1 are supported")
    rec = np.uint64(_faults.record(device).data.ptr)
    with _arrays.launch_context(ga):
        keys = _arrays.empty(ga, (ntok,), "int64")
        touched = _arrays.zeros(ga, (V,), "uint8")
        fn = _kernels.function(SOURCE, f"embedding_bwd_keys<{INDEX_CTYPES[ia.dtype]}>", device)
        _kernels.launch(fn, min(-(-ntok // 256), 4 * _kernels.sm_count(device) * 8), 256,
                        (ia, np.int64(ntok), np.int64(V), np.int64(pad), keys, touched, rec))
        vec = _vec(ga.itemsize, D, ga, dw)
        fn = _kernels.function(SOURCE, f"embedding_bwd_zero<{ga.ctype}, {vec}, {FWD_THREADS}>", device)
        _kernels.launch(fn, min(V, _kernels.resident_blocks(fn, FWD_THREADS, device)), FWD_THREADS,
                        (touched, np.int64(V), np.int32(D), dw))
        _arrays.as_cupy(keys).sort()  # unique keys: any sort order is the same, deterministic

        nchunks = -(-ntok // CHUNK)
        part = _arrays.empty(ga, (nchunks, 2, D), "float32")
        pidx = _arrays.empty(ga, (nchunks, 2), "int64")
        pcnt = _arrays.empty(ga, (nchunks, 2), "int32")
        own = _arrays.empty(ga, (nchunks,), "int32")
        tile = BWD_THREADS * BWD_NV * vec
        fn = _kernels.function(SOURCE, f"embedding_bwd_chunks<{ga.ctype}, {vec}, {BWD_NV}, {BWD_THREADS}>", device)
        _kernels.launch(fn, (nchunks, -(-D // tile)), BWD_THREADS, (
            keys, np.int64(ntok), np.int32(CHUNK), ga, np.int64(V), np.int32(D),
            np.int32(bool(scale_grad_by_freq)), dw, part, pidx, pcnt, own))
        fn = _kernels.function(SOURCE, f"embedding_bwd_combine<{ga.ctype}, {COMBINE_THREADS}>", device)
        _kernels.launch(fn, (nchunks, -(-D // COMBINE_THREADS)), COMBINE_THREADS, (
            part, pidx, pcnt, own, np.int64(nchunks), np.int32(D), np.int32(bool(scale_grad_by_freq)), dw))
    return dw.obj
