"""Rotary position embedding (RoPE) of queries and keys, forward and backward (kernels:
cuda_src/rope.cu), in the half-split layout of GPT-NeoX and Hugging Face's LLaMA / Mistral or
the interleaved one of GPT-J and Meta's LLaMA; and the inverse frequencies, LLaMA-3's scaling
included.

Shapes: ``q`` (B, Hq, S, D) and ``k`` (B, Hk, S, D) (any strides with a unit one along D: the
(B, S, H, D) projections viewed as (B, H, S, D) are read in place); ``cos`` and ``sin`` (B, S, D),
(1, S, D) or (S, D): a value for every element, as Hugging Face's rotary embedding makes them.
dtypes: float32, float16, bfloat16, one for every array of a call; or float32 cos and sin with
float16/bfloat16 q and k (as Hugging Face's models make them under autocast). Outputs take q's
and k's dtype and layout (their axes in the same order, dense).

Numerics: PyTorch eager's for ``q * cos + rotate_half(q) * sin`` in the input dtype (each
product rounded, then the sum). With float32 tables, PyTorch's promotion: the forward in
float32 (each product rounded to float32, then the sum) rounded once to q's dtype (as autocast
rounds it before attention); the backward's terms each rounded to q's dtype, as autograd
casts them.

This module is the whole Python side of the family (``FAMILY`` at the end).
"""
from __future__ import annotations

import functools
import math

import numpy as np

from . import _arrays, _kernels
from ._bench_cases import Case, TorchCase, elements_bytes, generator, randn
from ._arrays import DeviceArray
from ._family import Family, TorchOp
from ._kernels import Instance
from ._plans import Builder, Plan, PlanCache

__all__ = ["rope", "rope_backward", "rope_inv_freq"]

SOURCE = "rope.cu"
THREADS = 128


def instance(dtype: str, interleaved: bool, bwd: bool, vec: int, table: str | None = None) -> Instance:
    """``table``: the cos / sin dtype when it is not q's (float32 with 16-bit q)."""
    t = _arrays.DTYPES[dtype][0]
    c = _arrays.DTYPES[table][0] if table else t
    return Instance(SOURCE, f"rope_apply<{t}, {c}, {str(interleaved).lower()}, "
                            f"{str(bwd).lower()}, {vec}, {THREADS}>", THREADS)


HALF = ("float16", "bfloat16")


def _scalar_vec(interleaved: bool) -> int:
    """The width of the unaligned path: one element, or one pair when interleaved."""
    return 2 if interleaved else 1


def instances() -> list[Instance]:
    """Every kernel instance the fronts can launch (for the compile check)."""
    same = [instance(dtype, il, bwd, vec) for dtype, (_, size) in _arrays.DTYPES.items() for il in (False, True)
            for bwd in (False, True) for vec in (_scalar_vec(il), 16 // size)]
    promoted = [instance(dtype, il, bwd, vec, "float32") for dtype in HALF for il in (False, True)
                for bwd in (False, True) for vec in (_scalar_vec(il), 8)]
    return same + promoted


# ---- the inverse frequencies --------------------------------------------------------------------

def rope_inv_freq(dim: int, base: float = 10000.0, scaling: dict | None = None) -> np.ndarray:
    """The D/2 inverse frequencies ``base ** (-2i / D)`` (float64, NumPy), with Hugging Face's
    ``rope_scaling`` of LLaMA 3 applied when ``scaling`` is ``{"rope_type": "llama3", "factor",
    "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"}``: wavelengths
    beyond the low-frequency one divided by ``factor``, those below the high-frequency one kept,
    and a smooth blend between. ``cos = cos(positions ⊗ inv_freq)`` repeated to D (half-split:
    ``concat(f, f)``; interleaved: each frequency twice) is what ``rope`` takes."""
    if isinstance(dim, bool) or not isinstance(dim, (int, np.integer)) or dim < 2 or dim % 2:
        raise ValueError(f"dim: expected an even integer >= 2, got {dim!r}")
    if not (isinstance(base, (int, float)) and math.isfinite(base) and base > 1):
        raise ValueError(f"base: expected a finite number > 1, got {base!r}")
    inv = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    if scaling is None or scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        return inv
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind != "llama3":
        raise ValueError(f"scaling: rope_type {kind!r} is not supported (None, 'default' or 'llama3')")
    try:
        factor, low, high = (float(scaling[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
        old = float(scaling["original_max_position_embeddings"])
    except KeyError as e:
        raise ValueError(f"scaling: 'llama3' needs {e.args[0]!r}") from None
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, blended, scaled)


# ---- argument checks (kernels and references alike) -----------------------------------------

def _check(qa: DeviceArray, ka: DeviceArray | None, ca: DeviceArray, sa: DeviceArray, names=("q", "k")) -> None:
    if qa.ndim != 4:
        raise ValueError(f"{qa.name}: expected (B, H, S, D), got shape {qa.shape}")
    B, _, S, D = qa.shape
    if D % 2:
        raise ValueError(f"{qa.name}: the head dim D = {D} must be even (pairs of elements rotate)")
    if ka is not None and (ka.ndim != 4 or (ka.shape[0], ka.shape[2], ka.shape[3]) != (B, S, D)):
        raise ValueError(f"{ka.name}: expected (B, Hk, S, D) = ({B}, *, {S}, {D}), got shape {ka.shape}")
    if ca.shape not in ((B, S, D), (1, S, D), (S, D)):
        raise ValueError(f"{ca.name}: expected ({B} or 1, {S}, {D}) or ({S}, {D}), got shape {ca.shape}")
    if sa.shape != ca.shape:
        raise ValueError(f"{sa.name}: shape {sa.shape} does not match {ca.name}'s {ca.shape}")
    host64 = qa.kind == "numpy" and "float64" in (qa.dtype, getattr(ka, "dtype", None), ca.dtype, sa.dtype)
    if ka is not None and ka.dtype != qa.dtype and not host64:
        raise ValueError(f"{ka.name}: dtype {ka.dtype} differs from {qa.name}'s {qa.dtype}; "
                         "cast it so that q and k share one dtype")
    for a in (ca, sa):
        promoted = a.dtype == "float32" and qa.dtype in HALF
        if a.dtype != qa.dtype and not promoted and not host64:
            raise ValueError(f"{a.name}: dtype {a.dtype} differs from {qa.name}'s {qa.dtype} (float32 tables "
                             "are taken with float16/bfloat16 q and k); cast it")
    if sa.dtype != ca.dtype and not host64:
        raise ValueError(f"{sa.name}: dtype {sa.dtype} differs from {ca.name}'s {ca.dtype}")


def _interleaved(value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"interleaved: expected a bool, got {type(value).__name__}")
    return bool(value)


def _cs_strides(ca: DeviceArray) -> tuple[int, int]:
    """(batch stride, position stride) of a cos / sin table (0 for a shared batch)."""
    if ca.ndim == 2:
        return 0, ca.strides[0]
    return (0 if ca.shape[0] == 1 else ca.strides[0]), ca.strides[1]


# ---- forward and backward -----------------------------------------------------------------------

_PLANS = PlanCache()


def _apply(bwd: bool, q, k, cos, sin, interleaved):
    names = ("dq", "dk") if bwd else ("q", "k")
    arrays = [_arrays.as_device_array(q, names[0]), None if k is None else _arrays.as_device_array(k, names[1]),
              _arrays.as_device_array(cos, "cos"), _arrays.as_device_array(sin, "sin")]
    il = _interleaved(interleaved)
    key = (bwd, il, *(a and a.key for a in arrays))
    plan = _PLANS.plan(key, _plan, bwd, il, arrays)
    bufs = plan(arrays)
    return plan.out(bufs, "q"), plan.out(bufs, "k")


def _plan(bwd: bool, il: bool, arrays) -> Plan:
    qa, ka, ca, sa = arrays
    _check(qa, ka, ca, sa)
    device = _arrays.same_device(qa, ka, ca, sa)
    B, HQ, S, D = qa.shape
    HK = 0 if ka is None else ka.shape[1]
    b = Builder(arrays)
    c_order = (4, 3, 2, 1)

    def unit_inner(a) -> bool:
        return a.shape[-1] <= 1 or a.strides[-1] == 1

    # q and k: read in place with a unit stride along D, else a dense copy
    strides = {}
    for i, a in ((0, qa), (1, ka)):
        if a is None:
            strides[i] = (0, 0, 0, 1)
        elif unit_inner(a):
            strides[i] = a.strides
        else:
            b.fix(i, DeviceArray.contiguous)
            strides[i] = _arrays.like_strides(a.shape, c_order)
    # cos and sin: one set of strides for both, else dense copies of both
    if unit_inner(ca) and unit_inner(sa) and ca.strides == sa.strides:
        cs, tables_copied = _cs_strides(ca), False
    else:
        b.fix(2, DeviceArray.copy)
        b.fix(3, DeviceArray.copy)
        cs, tables_copied = ((S * D if ca.ndim == 3 and ca.shape[0] > 1 else 0), D), True
    # outputs dense, axes in the (read) input's order
    qo = b.alloc(qa.shape, qa.dtype, "like", 0, name="q")
    ko = b.alloc(ka.shape, ka.dtype, "like", 1, name="k") if ka is not None else b.absent("k")
    qos = _arrays.like_strides(qa.shape, strides[0])
    kos = (0, 0, 0, 1) if ka is None else _arrays.like_strides(ka.shape, strides[1])
    if B * S and D and HQ + HK:
        vec = 16 // qa.itemsize
        lanes = D if il else D // 2   # (the elements a row's vectors start in)
        row_strides = [strides[0][:3], strides[1][:3], qos[:3], kos[:3], cs]
        pointers = [a.ptr for i, a in ((0, qa), (1, ka)) if a is not None and i not in {j for j, _ in b.fixes}]
        if not tables_copied:
            pointers += [ca.ptr, sa.ptr]
        aligned = (lanes % vec == 0 and all(st % vec == 0 for group in row_strides for st in group)
                   and all(ptr % 16 == 0 for ptr in pointers))
        table = ca.dtype if ca.dtype != qa.dtype else None
        kern = _kernels.kernel(instance(qa.dtype, il, bwd, vec if aligned else _scalar_vec(il), table), device)
        qs, ks = strides[0], strides[1]
        b.launch(kern, B * S, q=b.slot(0), q_sb=qs[0], q_sh=qs[1], q_ss=qs[2],
                 k=b.slot(1), k_sb=ks[0], k_sh=ks[1], k_ss=ks[2], cos=b.slot(2), sin=b.slot(3),
                 cs_sb=cs[0], cs_ss=cs[1], q_out=qo, qo_sb=qos[0], qo_sh=qos[1], qo_ss=qos[2],
                 k_out=ko, ko_sb=kos[0], ko_sh=kos[1], ko_ss=kos[2], S=S, HQ=HQ, HK=HK, D=D)
    return b.plan(device)


def rope(q, k, cos, sin, *, interleaved=False):
    """Rotary position embedding of q and k: ``x * cos + rotate(x) * sin``.

    Args:
        q: (B, Hq, S, D), k: (B, Hk, S, D) or None: CuPy arrays or torch CUDA tensors of one
            dtype (float32, float16, bfloat16), any strides with a unit one along D.
        cos, sin: (B, S, D), (1, S, D) or (S, D) of q's dtype (see ``rope_inv_freq``).
        interleaved: pairs (2i, 2i + 1) (GPT-J, Meta's LLaMA) instead of (j, j + D/2)
            (GPT-NeoX, Hugging Face's LLaMA and Mistral).

    Returns:
        ``(q_out, k_out)`` (k_out None when k is), each laid out as its input (the same axis
        order, dense), of q's kind and device.
    """
    return _apply(False, q, k, cos, sin, interleaved)


def rope_backward(dq, dk, cos, sin, *, interleaved=False):
    """Gradients of ``rope``: ``(dq_in, dk_in)`` from the outputs' gradients (the rotation
    transposed); the same shapes and layouts as ``rope``'s."""
    return _apply(True, dq, dk, cos, sin, interleaved)


# ---- NumPy references ---------------------------------------------------------------------------

def _rounder(a: DeviceArray):
    if a.dtype in ("float32", "float64"):
        return lambda v: v
    t = _arrays._np_dtype(a.dtype)
    return lambda v: np.asarray(v).astype(t).astype(np.float64)


def _ref(bwd: bool, q, k, cos, sin, interleaved):
    names = ("dq", "dk") if bwd else ("q", "k")
    qa = _arrays.as_host_array(q, names[0])
    ka = None if k is None else _arrays.as_host_array(k, names[1])
    ca, sa = _arrays.as_host_array(cos, "cos"), _arrays.as_host_array(sin, "sin")
    _check(qa, ka, ca, sa)
    il = _interleaved(interleaved)
    rnd = _rounder(qa)
    promoted = ca.dtype == "float32" and qa.dtype in HALF
    f32 = (lambda v: np.asarray(v, np.float64).astype(np.float32).astype(np.float64)) if promoted else (lambda v: v)
    B, _, S, D = qa.shape
    c = np.broadcast_to(ca.obj.astype(np.float64).reshape(-1, S, D), (B, S, D))[:, None]
    s = np.broadcast_to(sa.obj.astype(np.float64).reshape(-1, S, D), (B, S, D))[:, None]

    def one(x):
        x = x.obj.astype(np.float64)
        lo = (slice(None), slice(None), slice(None), slice(0, None, 2) if il else slice(0, D // 2))
        hi = (slice(None), slice(None), slice(None), slice(1, None, 2) if il else slice(D // 2, None))
        out = np.empty_like(x)
        if not bwd and promoted:   # (float32 products and sum, one rounding to q's dtype)
            out[lo] = rnd(f32(f32(x[lo] * c[lo]) - f32(x[hi] * s[lo])))
            out[hi] = rnd(f32(f32(x[hi] * c[hi]) + f32(x[lo] * s[hi])))
        elif not bwd:
            out[lo] = rnd(rnd(x[lo] * c[lo]) - rnd(x[hi] * s[lo]))
            out[hi] = rnd(rnd(x[hi] * c[hi]) + rnd(x[lo] * s[hi]))
        else:   # (promoted: each float32 product rounded to q's dtype, as autograd's casts)
            out[lo] = rnd(rnd(f32(x[lo] * c[lo])) + rnd(f32(x[hi] * s[hi])))
            out[hi] = rnd(rnd(f32(x[hi] * c[hi])) - rnd(f32(x[lo] * s[lo])))
        return out
    return one(qa), None if ka is None else one(ka)


def reference_rope(q, k, cos, sin, *, interleaved=False):
    """``rope`` in float64 from the given (rounded) values, rounding where the kernels round."""
    return _ref(False, q, k, cos, sin, interleaved)


def reference_rope_backward(dq, dk, cos, sin, *, interleaved=False):
    """``rope_backward`` in float64."""
    return _ref(True, dq, dk, cos, sin, interleaved)


# ---- benchmark cases ----------------------------------------------------------------------------

# The workload: LLaMA-3 8B's attention inputs (32 query heads, 8 key heads, D 128) for 8 x 2048
# tokens, q and k the (B, H, S, D) views of (B, S, H, D) projections, as Hugging Face has them.
WORKLOAD = {"full": (8, 2048, 32, 8, 128), "quick": (2, 2048, 32, 8, 128), "dtype": "bfloat16"}


def _inputs(dims, dtype, seed, *, grad=False) -> dict:
    import torch

    B, S, HQ, HK, D = dims
    gen = generator(seed)
    q = randn((B, S, HQ, D), dtype, gen).transpose(1, 2)
    k = randn((B, S, HK, D), dtype, gen).transpose(1, 2)
    inv = torch.tensor(rope_inv_freq(D, 500000.0), device="cuda", dtype=torch.float32)
    f = torch.outer(torch.arange(S, device="cuda", dtype=torch.float32), inv)
    emb = torch.cat((f, f), dim=-1)[None]
    t = {"q": q, "k": k, "cos": emb.cos().to(q.dtype), "sin": emb.sin().to(q.dtype)}
    if grad:
        t["dq"] = randn((B, S, HQ, D), dtype, gen).transpose(1, 2)
        t["dk"] = randn((B, S, HK, D), dtype, gen).transpose(1, 2)
        t["leaves"] = tuple(x.detach().requires_grad_(True) for x in (q, k))
        t["liger_leaves"] = tuple(x.detach().clone().requires_grad_(True) for x in (q, k))
    return t


def _hf(q, k, cos, sin, interleaved: bool = False):
    """Hugging Face's apply_rotary_pos_emb (LLaMA's; Cohere's with ``interleaved``: pairs (2i,
    2i + 1)), as written there."""
    import torch

    def rotate_half(x):
        if interleaved:
            return torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return torch.cat((-x2, x1), dim=-1)

    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def _fwd(t):
    return rope(t["q"], t["k"], t["cos"], t["sin"])


def _torch_fwd(t):
    return _hf(t["q"], t["k"], t["cos"], t["sin"])


def _fwd_bwd(t):
    return (*rope(t["q"], t["k"], t["cos"], t["sin"]), *rope_backward(t["dq"], t["dk"], t["cos"], t["sin"]))


def _torch_fwd_bwd(t):
    import torch

    q, k = t["leaves"]
    oq, ok = _hf(q, k, t["cos"], t["sin"])
    return (oq.detach(), ok.detach(), *torch.autograd.grad((oq, ok), (q, k), (t["dq"], t["dk"])))


def bench_cases(quick: bool) -> list:
    """Bytes: read q and k, write their outputs (twice that with the backward); the tables are
    (S, D), a 1/(B·H) share, left out."""
    dims, dt = WORKLOAD["quick" if quick else "full"], WORKLOAD["dtype"]
    B, S, HQ, HK, D = dims
    shape = (B, HQ + HK, S, D)
    p = functools.partial
    return [Case("rope fwd", "rope", shape, dt, elements_bytes(shape, dt, 2), p(_inputs, dims, dt),
                        _fwd, _torch_fwd),
            Case("rope fwd+bwd", "rope", shape, dt, elements_bytes(shape, dt, 4),
                        p(_inputs, dims, dt, grad=True), _fwd_bwd, _torch_fwd_bwd)]


def _forward_on(F, t):
    """``F.apply_rotary_pos_emb`` where F has it (cukern.torch), else Hugging Face's code:
    (q_out, k_out)."""
    q, k = t["leaves"]
    fn = getattr(F, "apply_rotary_pos_emb", None) if F is not None else None
    return (fn or _hf)(q, k, t["cos"], t["sin"])


def _liger(t):
    from liger_kernel.transformers.rope import liger_rotary_pos_emb

    return tuple(liger_rotary_pos_emb(*t["liger_leaves"], t["cos"], t["sin"]))


def torch_bench_cases(quick: bool) -> list:
    """RoPE through cukern.torch with autograd against Hugging Face's code in eager and
    torch.compile, and Liger."""
    dims, dt = WORKLOAD["quick" if quick else "full"], WORKLOAD["dtype"]
    B, S, HQ, HK, D = dims
    shape = (B, HQ + HK, S, D)

    def make(seed):
        t = _inputs(dims, dt, seed, grad=True)
        t["dy"] = (t["dq"], t["dk"])
        return t
    return [TorchCase("rope fwd+bwd", "rope", shape, dt, elements_bytes(shape, dt, 4), make,
                             _forward_on, _fwd_bwd, liger=_liger, liger_leaves=True)]


# ---- PyTorch bindings -------------------------------------------------------------------------

def _fake(q, k, cos, sin, interleaved):
    import torch

    return tuple(torch.empty_strided(t.shape, _arrays.like_strides(tuple(t.shape), tuple(t.stride())),
                                     dtype=t.dtype, device=t.device) for t in (q, k))


def _bwd_fake(dq, dk, cos, sin, interleaved):
    return _fake(dq, dk, cos, sin, interleaved)


TORCH_OPS = (
    TorchOp("rope", "(Tensor q, Tensor k, Tensor cos, Tensor sin, bool interleaved) -> (Tensor, Tensor)",
            forward=lambda q, k, c, s, il: rope(q, k, c, s, interleaved=il),
            fake=_fake, visible=2,
            save=lambda inputs, outputs: ((inputs[2], inputs[3]), inputs[4]),
            backward_schema="(Tensor dq, Tensor dk, Tensor cos, Tensor sin, bool interleaved) -> (Tensor, Tensor)",
            backward=lambda dq, dk, c, s, il: rope_backward(dq, dk, c, s, interleaved=il), backward_fake=_bwd_fake,
            backward_args=lambda saved, state, grads, T: (grads[0], grads[1], *saved, state), grads_to=(0, 1),
            native=True),
)


def _why_not(T, q, k, cos, sin):
    """Why the kernels do not take Hugging Face's call on (B, H, S, D) q and k, or None."""
    if not (q.is_cuda and q.dim() == 4 and k.dim() == 4 and cos.dim() == 3 and cos.shape == sin.shape):
        return "not CUDA (B, H, S, D) q and k with (B, S, D) cos and sin"
    if cos.dtype != q.dtype or sin.dtype != q.dtype:
        # Hugging Face's models under autocast: float32 cos and sin, which promote the product to
        # float32; the kernels give it rounded to q's dtype, which is what autocast makes of it
        # before attention, so only there.
        if not (cos.dtype == sin.dtype == T.torch.float32 and q.dtype in T.HALF_DTYPES
                and T.torch.is_autocast_enabled("cuda") and T.torch.get_autocast_dtype("cuda") == q.dtype):
            return "cos and sin of another dtype than q and k, outside autocast to q's dtype"
        reason = T.float_params(q, k) or (None if cos.device == q.device == sin.device
                                          else "cos and sin on another device")
    else:
        reason = T.float_params(q, k, cos, sin)
    if reason is not None:
        return reason
    if q.shape[-1] % 2 or cos.shape[0] not in (1, q.shape[0]) or tuple(cos.shape[1:]) != (q.shape[2], q.shape[3]):
        return "shapes of q, cos and sin"
    if (k.shape[0], k.shape[2], k.shape[3]) != (q.shape[0], q.shape[2], q.shape[3]):
        return "k's batch, length or head_dim differs from q's"
    return None


def _torch_api(T, ops, modules) -> dict:
    """``cukern.torch.apply_rotary_pos_emb``: Hugging Face's function, on the kernels."""

    def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1, *, interleaved=False):
        """Hugging Face's ``apply_rotary_pos_emb`` (LLaMA, Mistral: half-split) with its
        signature: q (B, Hq, S, D) and k (B, Hk, S, D) with ``unsqueeze_dim=1``, or (B, S, H, D)
        with ``unsqueeze_dim=2``; cos, sin (B, S, D). ``interleaved``: pairs (2i, 2i + 1), as
        Cohere's (``x * cos + rotate(x) * sin`` with rotate(x) = (-x1, x0, -x3, x2, ...) and the
        tables read element by element). Autograd gives q's and k's gradients; for tensors the
        kernels do not take, Hugging Face's code (``cukern.torch.counts()``)."""
        if unsqueeze_dim not in (1, 2):
            raise ValueError(f"unsqueeze_dim: expected 1 (B, H, S, D) or 2 (B, S, H, D), got {unsqueeze_dim!r}")
        if unsqueeze_dim == 2:
            q, k = q.transpose(1, 2), k.transpose(1, 2)
        reason = _why_not(T, q, k, cos, sin)
        compiling = T.compiling()
        if not compiling:
            T.count("rope", reason)
        il = bool(interleaved)
        if reason is not None:
            oq, okk = _hf(q, k, cos, sin, il)
        else:   # (inside torch.compile too: the op measured faster than what Inductor makes of HF's code)
            op = ops["rope"]
            oq, okk = op.compiled(q, k, cos, sin, il) if compiling else op(q, k, cos, sin, il)
        if unsqueeze_dim == 2:
            oq, okk = oq.transpose(1, 2), okk.transpose(1, 2)
        return oq, okk

    return {"apply_rotary_pos_emb": apply_rotary_pos_emb}


FAMILY = Family(
    name="rope",
    api=(rope, rope_backward, rope_inv_freq),
    references={"rope": reference_rope, "rope_backward": reference_rope_backward},
    instances=instances,
    bench=bench_cases,
    torch_bench=torch_bench_cases,
    torch_ops=TORCH_OPS,
    torch_api=_torch_api,
)
