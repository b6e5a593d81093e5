"""Embedding lookup and its dense, deterministic weight gradient (kernels: cuda_src/embedding.cu).

Shapes: ``indices`` any shape (*), int32 or int64; ``weight`` (V, D); outputs (*, D).
dtypes: float32, float16, bfloat16 for weight and grad; accumulation in float32.
Out-of-range indices never touch memory out of bounds: they are recorded on the device and
raised as ``IndexError`` by ``cukern.check_errors()`` (or at once with ``check=True``).

The whole Python side of the family: configurations, array functions with launch plans, the
NumPy references, benchmark cases and PyTorch bindings (``FAMILY`` at the end).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from . import _arrays, _checks, _faults, _kernels
from ._bench_cases import Case, TorchCase, elements_bytes, generator, randn
from ._arrays import DeviceArray
from ._family import DropIn, Family, ModuleSpec, TorchOp
from ._kernels import Instance
from ._plans import Builder, Plan, PlanCache

__all__ = ["embedding", "embedding_backward"]

SOURCE = "embedding.cu"
INDEX_CTYPES = {"int32": "int", "int64": "long long"}


# ---- kernel configurations --------------------------------------------------------------------

@dataclass(frozen=True, eq=False)   # (hashed by identity: plans are keyed by it, on every call)
class Configs:
    """Launch shapes, measured (docs/notes-embedding.md):

    fwd_threads: a block a token (512: 128 measured 4x slower at D = 4096); rows of at most
    warp_row_bytes go a warp a token in blocks of warp_threads (faster up to D = 2048 bf16,
    slower at 4096). Backward: the keys sorted sort_bits a pass, sort_warps * 32 *
    sort_items keys a block; the sums kernel takes units of ``chunk`` sorted entries
    (``chunk_small`` where that leaves fewer units than half the resident blocks) and beside them at
    most ``zero_rows`` rows of the table to zero, over column tiles of the first of
    ``bwd_shapes`` (threads, vectors a thread) that covers the row (else the last); the
    combine kernel takes combine_threads * 4 columns a block (* 1 for widths not a multiple
    of 4)."""
    fwd_threads: int = 512
    warp_row_bytes: int = 4096
    warp_threads: int = 256
    chunk: int = 128
    chunk_small: int = 64
    bwd_shapes: tuple = ((128, 1), (256, 1), (512, 1), (512, 2))
    zero_rows: int = 256
    combine_threads: int = 128
    keys_threads: int = 256
    sort_bits: int = 9
    sort_warps: int = 16
    sort_items: int = 8

    @property
    def sort_tile(self) -> int:
        return self.sort_warps * 32 * self.sort_items

    def fwd(self, dtype: str, index: str, vec: int, warp: bool) -> Instance:
        ctype, ic = _arrays.DTYPES[dtype][0], INDEX_CTYPES[index]
        if warp:
            return Instance(SOURCE, f"embedding_fwd_warp<{ctype}, {ic}, {vec}, {self.warp_threads}>", self.warp_threads)
        return Instance(SOURCE, f"embedding_fwd<{ctype}, {ic}, {vec}, {self.fwd_threads}>", self.fwd_threads)

    def keys(self, index: str) -> Instance:
        return Instance(SOURCE, f"embedding_bwd_keys<{INDEX_CTYPES[index]}, {self.sort_bits}, {self.sort_tile}>",
                        self.keys_threads)

    def sort_pass(self) -> Instance:
        return Instance(SOURCE, f"embedding_bwd_sort_pass<{self.sort_bits}, {self.sort_warps}, {self.sort_items}>",
                        self.sort_warps * 32)

    def bwd_shape(self, d: int, vec: int) -> tuple:
        """(threads, vectors a thread) of the sums kernel for rows of d elements."""
        return next((s for s in self.bwd_shapes if s[0] * s[1] * vec >= d), self.bwd_shapes[-1])

    def chunks(self, dtype: str, vec: int, shape: tuple) -> Instance:
        threads, nv = shape
        cmax, minb = max(self.chunk, self.chunk_small), max(1, 1024 // (threads * nv))
        return Instance(SOURCE, f"embedding_bwd_chunks<{_arrays.DTYPES[dtype][0]}, {vec}, {nv}, {threads}, {cmax}, "
                                f"{self.zero_rows}, {minb}>", threads)

    def combine(self, dtype: str, cv: int) -> Instance:
        return Instance(SOURCE, f"embedding_bwd_combine<{_arrays.DTYPES[dtype][0]}, {self.combine_threads}, {cv}>",
                        self.combine_threads)


CONFIGS = Configs()


def instances(configs: Configs = CONFIGS) -> list[Instance]:
    """Every kernel instance the fronts can launch (for the compile check)."""
    out = []
    for dtype, (_, itemsize) in _arrays.DTYPES.items():
        for vec in sorted({1, 16 // itemsize}):
            out += [configs.fwd(dtype, ix, vec, warp) for warp in (False, True) for ix in INDEX_CTYPES]
            out += [configs.chunks(dtype, vec, shape) for shape in configs.bwd_shapes]
        out += [configs.combine(dtype, cv) for cv in (1, 4)]
    return out + [configs.keys(ix) for ix in INDEX_CTYPES] + [configs.sort_pass()]


def _vec(itemsize: int, d: int, *arrays) -> int:
    vec = 16 // itemsize
    if d % vec or any(a is not None and a.ptr % 16 for a in arrays):
        return 1
    return vec


# ---- argument checks (kernels and references alike) -----------------------------------------

def _check_weight(wa: DeviceArray) -> None:
    if wa.ndim != 2:
        raise ValueError(f"{wa.name}: must be 2-D (num_embeddings, embedding_dim), got shape {wa.shape}")


def _padding(padding_idx, v: int) -> int:
    """torch's rule: -V <= padding_idx < V; negative counts from the end. -1 for none."""
    if padding_idx is None:
        return -1
    p = _checks.index(padding_idx, "padding_idx")
    if not -v <= p < v:
        raise ValueError(f"padding_idx: {p} is out of range for {v} embeddings (need -{v} <= padding_idx < {v})")
    return p % v


def _num_embeddings(num_embeddings) -> int:
    v = _checks.index(num_embeddings, "num_embeddings")
    if v < 1:
        raise ValueError(f"num_embeddings: must be at least 1, got {v}")
    return v


def _check_grad(ga: DeviceArray, ia: DeviceArray) -> None:
    if ga.ndim < 1 or ga.shape[:-1] != ia.shape:
        raise ValueError(f"{ga.name}: shape {ga.shape} does not match indices' shape {ia.shape} + (embedding_dim,)")


def _out_of_range(ia: DeviceArray, v: int) -> int | None:
    """The first out-of-range index (one host synchronization), or None. NumPy, CuPy and
    torch arrays alike."""
    a = ia.obj
    if ia.size == 0:
        return None
    bad = (a < 0) | (a >= v)
    if not bool(bad.any()):
        return None
    return int(a[bad].reshape(-1)[0])


def _raise_out_of_range(ia: DeviceArray, v: int) -> None:
    value = _out_of_range(ia, v)
    if value is not None:
        raise IndexError(f"{ia.name}: index {value} is out of range for {v} embeddings (valid: 0 to {v - 1})")


def _indices(obj) -> DeviceArray:
    return _arrays.as_device_array(obj, "indices", tuple(INDEX_CTYPES))


# ---- forward --------------------------------------------------------------------------------

_FWD = PlanCache()


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
    return _embedding(indices, weight, padding_idx, check, CONFIGS)


def _embedding(indices, weight, padding_idx, check, configs: Configs):
    arrays = [_indices(indices), _arrays.as_device_array(weight, "weight")]
    plain = padding_idx is None or type(padding_idx) is int
    key = (padding_idx, configs, *(a.key for a in arrays))
    plan = _FWD.plan(key if plain else None, _plan_forward, arrays, padding_idx, configs)
    if check:
        _raise_out_of_range(arrays[0], arrays[1].shape[0])
    return plan.out(plan(arrays), "out")


def _plan_forward(arrays, padding_idx, configs: Configs) -> Plan:
    ia, wa = arrays
    _check_weight(wa)
    device = _arrays.same_device(ia, wa)
    v, d = wa.shape
    _padding(padding_idx, v)
    b = Builder(arrays)
    if not _arrays.is_contiguous(ia):
        b.fix(0, DeviceArray.contiguous)
    if not _arrays.is_contiguous(wa):
        b.fix(1, DeviceArray.contiguous)
    out = b.alloc(ia.shape + (d,), wa.dtype, name="out")
    ntok = ia.size
    if ntok and d:
        vec = _vec(wa.itemsize, d, wa if _arrays.is_contiguous(wa) else None)
        warp = d * wa.itemsize <= configs.warp_row_bytes
        k = _kernels.kernel(configs.fwd(wa.dtype, ia.dtype, vec, warp), device)
        per_block = configs.warp_threads // 32 if warp else 1
        b.launch(k, min(-(-ntok // per_block), k.resident_blocks()), indices=b.slot(0), ntok=ntok,
                 weight=b.slot(1), V=v, D=d, out=out, fault=_arrays.wrap(_faults.record(device), "fault record"))
    return b.plan(device, first=1)


# ---- backward -------------------------------------------------------------------------------

_BWD = PlanCache()


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
    return _embedding_backward(grad, indices, num_embeddings, padding_idx, scale_grad_by_freq, check, CONFIGS)


def _embedding_backward(grad, indices, num_embeddings, padding_idx, scale_grad_by_freq, check, configs: Configs):
    arrays = [_arrays.as_device_array(grad, "grad"), _indices(indices)]
    plain = type(num_embeddings) is int and (padding_idx is None or type(padding_idx) is int)
    key = (num_embeddings, padding_idx, bool(scale_grad_by_freq), configs, *(a.key for a in arrays))
    plan = _BWD.plan(key if plain else None, _plan_backward, arrays, num_embeddings, padding_idx,
                     bool(scale_grad_by_freq), configs)
    if check:
        _raise_out_of_range(arrays[1], num_embeddings)
    return plan.out(plan(arrays), "dweight")


def _plan_backward(arrays, num_embeddings, padding_idx, scale, configs: Configs) -> Plan:
    ga, ia = arrays
    v = _num_embeddings(num_embeddings)
    _check_grad(ga, ia)
    device = _arrays.same_device(ga, ia)
    pad = _padding(padding_idx, v)
    d = ga.shape[-1]
    ntok = ia.size
    if ntok >= 2**32:
        raise ValueError(f"indices: {ntok} tokens; at most 2**32 - 1 are supported")
    b = Builder(arrays)
    for i, a in enumerate(arrays):
        if not _arrays.is_contiguous(a):
            b.fix(i, DeviceArray.contiguous)
    dw = b.alloc((v, d), ga.dtype, name="dweight")
    if not (ntok and d):
        b.fill(0.0, dw)
        return b.plan(device)
    fault = _arrays.wrap(_faults.record(device), "fault record")
    # the sort: a pass a sort_bits digit of the indices, V (padding's) included
    bits, radix, tile = max(1, v.bit_length()), 1 << configs.sort_bits, configs.sort_tile
    passes, ntiles = -(-bits // configs.sort_bits), -(-ntok // tile)
    keys, keys_other = b.alloc((ntok,), "int64"), b.alloc((ntok,), "int64")
    # touched flags, each pass's digit counts, the count of crossing runs
    counts = b.alloc((v + passes * radix * ntiles + 1,), "int32")

    def digit_counts(p):
        return counts + 4 * (v + p * radix * ntiles)

    nowners = digit_counts(passes)
    vec = _vec(ga.itemsize, d, ga if _arrays.is_contiguous(ga) else None)
    shape = configs.bwd_shape(d, vec)
    sums = _kernels.kernel(configs.chunks(ga.dtype, vec, shape), device)
    threads, nv = shape
    tiles = -(-d // (threads * nv * vec))
    chunk = configs.chunk if -(-ntok // configs.chunk) * tiles >= sums.resident_blocks() // 2 else configs.chunk_small
    nchunks = -(-ntok // chunk)
    part = b.alloc((nchunks, 2, d), "float32")
    pidx = b.alloc((nchunks, 2), "int64")
    pcnt = b.alloc((nchunks, 2), "int32")
    owners = b.alloc((nchunks,), "int32")
    b.fill(0, counts)
    k = _kernels.kernel(configs.keys(ia.dtype), device)
    b.launch(k, min(-(-ntok // configs.keys_threads), 32 * _kernels.sm_count(device)), indices=b.slot(1),
             ntok=ntok, V=v, padding=pad, keys=keys, touched=counts, counts=digit_counts(0), ntiles=ntiles,
             fault=fault)
    sort_pass = _kernels.kernel(configs.sort_pass(), device)
    for p in range(passes):
        b.launch(sort_pass, ntiles, src=keys, dst=keys_other, n=ntok, shift=p * configs.sort_bits,
                 counts=digit_counts(p), ntiles=ntiles, next=digit_counts(p + 1) if p + 1 < passes else None,
                 next_shift=(p + 1) * configs.sort_bits)
        keys, keys_other = keys_other, keys
    # units: every chunk of entries, and at least enough that each zeroes at most zero_rows rows
    nunits = max(nchunks, -(-v // configs.zero_rows))
    zrows = -(-v // nunits)
    b.launch(sums, min(nunits * tiles, sums.resident_blocks()), keys=keys, n=ntok, C=chunk, nchunks=nchunks,
             nunits=nunits, tiles=tiles, zrows=zrows, zper=-(-zrows // chunk), touched=counts, grad=b.slot(0), V=v,
             D=d, scale_by_freq=int(scale), dweight=dw, part=part, pidx=pidx, pcnt=pcnt, owners=owners,
             nowners=nowners)
    cv = 4 if d % 4 == 0 else 1
    k = _kernels.kernel(configs.combine(ga.dtype, cv), device)
    b.launch(k, max(1, min(4 * k.resident_blocks(), nchunks * -(-d // (configs.combine_threads * cv)))), keys=keys,
             n=ntok, C=chunk, nchunks=nchunks, part=part, pidx=pidx, pcnt=pcnt, owners=owners, nowners=nowners, D=d,
             scale_by_freq=int(scale), dweight=dw)
    return b.plan(device)


# ---- NumPy references ------------------------------------------------------------------------

def reference_embedding(indices, weight, padding_idx=None, *, check=False):
    """``embedding`` in float64: ``weight[indices]``. Out-of-range indices raise IndexError
    (``check`` is accepted for the same signature; the reference always checks)."""
    ia = _arrays.as_host_array(indices, "indices", tuple(INDEX_CTYPES))
    wa = _arrays.as_host_array(weight, "weight")
    _check_weight(wa)
    v = wa.shape[0]
    _padding(padding_idx, v)
    _raise_out_of_range(ia, v)
    return wa.obj.astype(np.float64)[ia.obj.astype(np.int64)]


def reference_embedding_backward(grad, indices, num_embeddings, padding_idx=None, scale_grad_by_freq=False, *,
                                 check=False):
    """``embedding_backward`` in float64: row v is the sum (np.add.at) of the grad rows whose
    index is v, divided by its count with ``scale_grad_by_freq``; zero for rows never looked up
    and for the padding row."""
    ga = _arrays.as_host_array(grad, "grad")
    ia = _arrays.as_host_array(indices, "indices", tuple(INDEX_CTYPES))
    v = _num_embeddings(num_embeddings)
    _check_grad(ga, ia)
    pad = _padding(padding_idx, v)
    _raise_out_of_range(ia, v)
    d = ga.shape[-1]
    flat, rows = ia.obj.reshape(-1).astype(np.int64), ga.obj.astype(np.float64).reshape(-1, d)
    out = np.zeros((v, d), np.float64)
    np.add.at(out, flat, rows)
    if scale_grad_by_freq:
        counts = np.bincount(flat, minlength=v).astype(np.float64)
        out /= np.maximum(counts, 1.0)[:, None]
    if pad >= 0:
        out[pad] = 0.0
    return out


# ---- benchmark cases ----------------------------------------------------------------------------

# (tokens, vocabulary, model dim): LLaMA-3's table for a batch of 32 x 2048 tokens.
WORKLOAD = {"full": (65536, 128256, 4096), "quick": (8192, 32000, 4096), "dtype": "bfloat16"}


def _inputs(T, V, D, dtype, seed, *, grad=False, zipf=False) -> dict:
    import torch

    gen = generator(seed)
    if zipf:  # a Zipf-like token distribution, as in real text (a few very hot tokens)
        ranks = np.random.default_rng(seed).zipf(1.2, T) % V
        idx = torch.from_numpy(ranks.astype(np.int64)).cuda()
    else:
        idx = torch.randint(0, V, (T,), device="cuda", generator=gen)
    t = {"idx": idx, "w": randn((V, D), dtype, gen)}
    if grad:
        t["dy"] = randn((T, D), dtype, gen)
        t["leaves"] = (t["w"].detach().requires_grad_(True),)
    return t


def _fwd(t):
    return embedding(t["idx"], t["w"])


def _torch_fwd(t):
    import torch.nn.functional as F

    return F.embedding(t["idx"], t["w"])


def _bwd(t):
    return embedding_backward(t["dy"], t["idx"], t["w"].shape[0])


def _torch_bwd(t):
    import torch

    return torch.ops.aten.embedding_dense_backward(t["dy"], t["idx"], t["w"].shape[0], -1, False)


def _fwd_bwd(t):
    return embedding(t["idx"], t["w"]), embedding_backward(t["dy"], t["idx"], t["w"].shape[0])


def _forward_on(F, t):
    if F is None:
        import torch.nn.functional as F
    return F.embedding(t["idx"], t["leaves"][0])


def _torch_fwd_bwd(t):
    import torch

    y = _forward_on(None, t)
    return (y.detach(), *torch.autograd.grad(y, t["leaves"], t["dy"]))


def bench_cases(quick: bool) -> list:
    """T tokens from a (V, D) table. fwd: read T rows, write T rows (2 T·D); bwd (dense): read
    T grad rows, write the V·D table gradient ((T + V)·D)."""
    (T, V, D), dt = WORKLOAD["quick" if quick else "full"], WORKLOAD["dtype"]
    make = functools.partial(_inputs, T, V, D, dt)
    fwd_bytes, bwd_bytes = elements_bytes((2 * T, D), dt), elements_bytes((T + V, D), dt)
    shape = (T, V, D)
    return [
        Case("embedding fwd", "embedding", shape, dt, fwd_bytes, make, _fwd, _torch_fwd),
        Case("embedding bwd", "embedding", shape, dt, bwd_bytes, functools.partial(make, grad=True), _bwd,
                    _torch_bwd),
        Case("embedding bwd zipf", "embedding", shape, dt, bwd_bytes,
                    functools.partial(make, grad=True, zipf=True), _bwd, _torch_bwd),
        Case("embedding fwd+bwd", "embedding", shape, dt, fwd_bytes + bwd_bytes,
                    functools.partial(make, grad=True), _fwd_bwd, _torch_fwd_bwd),
    ]


def _liger(t):
    from liger_kernel.ops.experimental.embedding import LigerEmbeddingFunction

    return LigerEmbeddingFunction.apply(t["leaves"][0], t["idx"])


def torch_bench_cases(quick: bool) -> list:
    (T, V, D), dt = WORKLOAD["quick" if quick else "full"], WORKLOAD["dtype"]
    nbytes = elements_bytes((2 * T, D), dt) + elements_bytes((T + V, D), dt)
    return [TorchCase("embedding fwd+bwd", "embedding", (T, V, D), dt, nbytes,
                             functools.partial(_inputs, T, V, D, dt, grad=True), _forward_on, _fwd_bwd,
                             liger=_liger)]


# ---- PyTorch bindings -------------------------------------------------------------------------

def _fake(indices, weight, padding_idx, scale_grad_by_freq):
    return weight.new_empty((*indices.shape, weight.shape[1]))


def _bwd_fake(grad, indices, num_embeddings, padding_idx, scale_grad_by_freq):
    return (grad.new_empty((num_embeddings, grad.shape[-1])),)


TORCH_OPS = (
    TorchOp("embedding", "(Tensor indices, Tensor weight, int? padding_idx, bool scale_grad_by_freq) -> Tensor",
            forward=lambda i, w, p, s: (embedding(i, w, p),),
            inference=lambda i, w, p, s: embedding(i, w, p),
            fake=lambda i, w, p, s: (_fake(i, w, p, s),),
            save=lambda inputs, outputs: ((inputs[0],), (inputs[1].shape[0], inputs[2], inputs[3])),
            backward_schema="(Tensor grad, Tensor indices, int num_embeddings, int? padding_idx, "
                            "bool scale_grad_by_freq) -> Tensor",
            backward=lambda g, i, v, p, s: (embedding_backward(g, i, v, p, s),),
            backward_fake=_bwd_fake,
            backward_args=lambda saved, state, grads, T: (grads[0], saved[0], *state),
            grads_to=(1,), native=True),
)


def _route(T, input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
           sparse=False):
    if not (input.is_cuda and weight.is_cuda and input.device == weight.device):
        return "not CUDA tensors on one device"
    if input.dtype not in T.INDEX_DTYPES or weight.dtype not in T.FLOAT_DTYPES or weight.dim() != 2:
        return "dtype or weight shape"
    if max_norm is not None or sparse:
        return "max_norm or sparse"
    if padding_idx is not None and not -weight.shape[0] <= padding_idx < weight.shape[0]:
        return "padding_idx out of range"
    if T.small("embedding", input.numel() * weight.shape[1]):
        return T.SMALL
    return "embedding", (input, weight, padding_idx, bool(scale_grad_by_freq)), None


FAMILY = Family(
    name="embedding",
    api=(embedding, embedding_backward),
    references={"embedding": reference_embedding, "embedding_backward": reference_embedding_backward},
    instances=instances,
    bench=bench_cases,
    torch_bench=torch_bench_cases,
    torch_ops=TORCH_OPS,
    dropins=(DropIn("embedding", _route, compile=True, min_size=2**20),),   # (output elements)
    modules=(ModuleSpec("Embedding", "Embedding", "embedding",
                        lambda m, x: (x, m.weight, m.padding_idx, m.max_norm, m.norm_type, m.scale_grad_by_freq,
                                      m.sparse)),),
)
