"""Drop-ins for ``torch.nn.functional``'s layer_norm, rms_norm, group_norm, embedding and
scaled_dot_product_attention, with the same signatures: a call cukern supports goes to its
kernels (``torch.ops.cukern.*``), any other to PyTorch's own function, so whatever a model
passes keeps working. ``counts()`` says which calls went where.

Mixed precision follows PyTorch: under ``torch.autocast`` the inputs are cast the way
autocast casts them for PyTorch's op (measured once per (op, dtypes) by calling that op on a
tiny tensor, so it tracks the installed PyTorch), e.g. layer_norm computes in float32 and
scaled_dot_product_attention in the autocast dtype.
"""
from __future__ import annotations

import math
import threading
import types
from collections import defaultdict
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..attention import HEAD_DIMS as _ATTN_HEAD_DIMS
from . import _eager, _ops

# PyTorch's own functions, saved before any patching (the fallbacks).
ORIGINAL: dict[str, Callable] = {name: getattr(F, name) for name in
                                 ("layer_norm", "rms_norm", "group_norm", "embedding",
                                  "scaled_dot_product_attention")}
ORIGINAL_F = types.SimpleNamespace(**ORIGINAL)   # (the same, as attributes: ORIGINAL_F.layer_norm)
_FLOAT = (torch.float32, torch.float16, torch.bfloat16)
_HALF = (torch.float16, torch.bfloat16)


def _compiling() -> bool:
    """Inside a torch.compile trace: the custom ops (traceable) instead of the eager path."""
    return torch.compiler.is_compiling()


# ---- counts ----------------------------------------------------------------------------------

_counts: dict[str, dict[str, int]] = defaultdict(lambda: {"cukern": 0, "torch": 0})
_reasons: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
_lock = threading.Lock()


def _count(op: str, reason: Optional[str]) -> None:
    """Eager calls only: inside a torch.compile trace the routing is fixed in the graph
    (visible there as torch.ops.cukern.*), and a trace-time count would mislead."""
    if _compiling():
        return
    with _lock:
        _counts[op]["cukern" if reason is None else "torch"] += 1
        if reason is not None:
            _reasons[op][reason] += 1


def counts(reasons: bool = False) -> dict:
    """{op: {"cukern": n, "torch": m}} of the eager calls since the last ``reset_counts()``;
    with ``reasons=True`` also {op: {"torch": {reason: n}}} for the fallbacks."""
    with _lock:
        out = {op: dict(c) for op, c in _counts.items()}
        if reasons:
            for op, r in _reasons.items():
                out.setdefault(op, {"cukern": 0, "torch": 0})["torch_reasons"] = dict(r)
        return out


def reset_counts() -> None:
    with _lock:
        _counts.clear()
        _reasons.clear()


# ---- autocast --------------------------------------------------------------------------------

_policy: dict[tuple, torch.dtype] = {}


_POLICY_OPS = ("layer_norm", "rms_norm", "group_norm", "scaled_dot_product_attention")


def _autocast_dtype(op: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype PyTorch's ``op`` computes in for an input of ``dtype`` under the current
    CUDA autocast (``dtype`` itself when autocast is off)."""
    if not torch.is_autocast_enabled("cuda"):
        return dtype
    ac = torch.get_autocast_dtype("cuda")
    key = (op, dtype, ac)
    if key not in _policy:   # (prepare() fills the table eagerly, so traces never probe)
        _policy[key] = _probe(op, dtype, ac, device)
    return _policy[key]


def prepare() -> None:
    """Measure the autocast table for every op, input and autocast dtype (24 tiny calls on
    the current CUDA device); patch() calls it, so that torch.compile traces find it full."""
    if not torch.cuda.is_available():
        return
    dev = torch.device("cuda", torch.cuda.current_device())
    for op in _POLICY_OPS:
        for dt in _FLOAT:
            for ac in _HALF:
                _policy.setdefault((op, dt, ac), _probe(op, dt, ac, dev))


@torch.compiler.disable
def _probe(op: str, dtype: torch.dtype, ac: torch.dtype, device: torch.device) -> torch.dtype:
    x = torch.ones((2, 4, 2, 8), dtype=dtype, device=device)
    with torch.autocast("cuda", dtype=ac):
        if op in ("layer_norm", "rms_norm"):
            y = ORIGINAL[op](x, (8,))
        elif op == "group_norm":
            y = ORIGINAL[op](x, 2)
        else:  # scaled_dot_product_attention
            y = ORIGINAL[op](x, x, x)
    return y.dtype


def _cast(t: Optional[Tensor], dtype: torch.dtype) -> Optional[Tensor]:
    return t if t is None or t.dtype == dtype else t.to(dtype)


def _same_device_float(x: Tensor, *params: Optional[Tensor]) -> Optional[str]:
    """Why x and its parameters do not suit the kernels, or None."""
    if not x.is_cuda:
        return "not a CUDA tensor"
    if x.dtype not in _FLOAT:
        return f"dtype {x.dtype}"
    for p in params:
        if p is not None and (p.device != x.device or p.dtype != x.dtype):
            return "parameter dtype or device differs from the input's"
    return None


# ---- norms -----------------------------------------------------------------------------------

def _norm_shape(x: Tensor, normalized_shape) -> Optional[int]:
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if not shape or tuple(x.shape[x.dim() - len(shape):]) != shape or x.dim() < len(shape):
        return None
    return math.prod(shape)


def layer_norm(input: Tensor, normalized_shape, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None,
               eps: float = 1e-5) -> Tensor:
    """``F.layer_norm`` on cukern's kernel when it can; PyTorch's otherwise."""
    reason = "not a CUDA tensor" if not input.is_cuda else None
    if reason is None:
        dt = _autocast_dtype("layer_norm", input.dtype, input.device)
        x, w, b = _cast(input, dt), _cast(weight, dt), _cast(bias, dt)
        d = _norm_shape(x, normalized_shape)
        reason = _same_device_float(x, w, b) or (None if d else "normalized_shape does not match the input")
    if reason is not None:
        _count("layer_norm", reason)
        return ORIGINAL["layer_norm"](input, normalized_shape, weight, bias, eps)
    _count("layer_norm", None)
    lead = x.shape[: x.dim() - (1 if isinstance(normalized_shape, int) else len(normalized_shape))]
    args = (x.reshape(*lead, d), None if w is None else w.reshape(d), None if b is None else b.reshape(d),
            float(eps))
    y = _ops.layer_norm(*args)[0] if _compiling() else _eager.layer_norm(*args)
    return y.view(x.shape)


def rms_norm(input: Tensor, normalized_shape, weight: Optional[Tensor] = None, eps: Optional[float] = None) -> Tensor:
    """``F.rms_norm`` on cukern's kernel when it can; PyTorch's otherwise. ``eps=None`` is
    PyTorch's default, the machine epsilon of the float32 arithmetic it computes in."""
    reason = "not a CUDA tensor" if not input.is_cuda else None
    if reason is None:
        dt = _autocast_dtype("rms_norm", input.dtype, input.device)
        x, w = _cast(input, dt), _cast(weight, dt)
        d = _norm_shape(x, normalized_shape)
        reason = _same_device_float(x, w) or (None if d else "normalized_shape does not match the input")
    if reason is not None:
        _count("rms_norm", reason)
        return ORIGINAL["rms_norm"](input, normalized_shape, weight, eps)
    _count("rms_norm", None)
    e = float(torch.finfo(torch.float32).eps) if eps is None else float(eps)
    lead = x.shape[: x.dim() - (1 if isinstance(normalized_shape, int) else len(normalized_shape))]
    args = (x.reshape(*lead, d), None if w is None else w.reshape(d), e)
    y = _ops.rms_norm(*args)[0] if _compiling() else _eager.rms_norm(*args)
    return y.view(x.shape)


def group_norm(input: Tensor, num_groups: int, weight: Optional[Tensor] = None, bias: Optional[Tensor] = None,
               eps: float = 1e-5) -> Tensor:
    """``F.group_norm`` on cukern's kernel when it can; PyTorch's otherwise."""
    reason = "not a CUDA tensor" if not input.is_cuda else None
    if reason is None:
        dt = _autocast_dtype("group_norm", input.dtype, input.device)
        x, w, b = _cast(input, dt), _cast(weight, dt), _cast(bias, dt)
        reason = _same_device_float(x, w, b)
        if reason is None and (x.dim() < 2 or not isinstance(num_groups, int) or num_groups < 1
                               or x.shape[1] % num_groups):
            reason = "shape or num_groups"
    if reason is not None:
        _count("group_norm", reason)
        return ORIGINAL["group_norm"](input, num_groups, weight, bias, eps)
    _count("group_norm", None)
    channels_last = x.dim() >= 3 and x.stride(1) == 1 and x.shape[1] > 1 and \
        x.permute(0, *range(2, x.dim()), 1).is_contiguous()
    if not (channels_last or x.is_contiguous()):
        x = x.contiguous()
    if _compiling():
        return _ops.group_norm(x, num_groups, w, b, float(eps))[0]
    return _eager.group_norm(x, num_groups, w, b, float(eps))


# ---- embedding -------------------------------------------------------------------------------

def embedding(input: Tensor, weight: Tensor, padding_idx: Optional[int] = None, max_norm: Optional[float] = None,
              norm_type: float = 2.0, scale_grad_by_freq: bool = False, sparse: bool = False) -> Tensor:
    """``F.embedding`` on cukern's kernels when it can (no max_norm, dense gradient);
    PyTorch's otherwise."""
    reason = None
    if not (input.is_cuda and weight.is_cuda and input.device == weight.device):
        reason = "not CUDA tensors on one device"
    elif input.dtype not in (torch.int32, torch.int64) or weight.dtype not in _FLOAT or weight.dim() != 2:
        reason = "dtype or weight shape"
    elif max_norm is not None or sparse:
        reason = "max_norm or sparse"
    elif padding_idx is not None and not -weight.shape[0] <= padding_idx < weight.shape[0]:
        reason = "padding_idx out of range"
    if reason is not None:
        _count("embedding", reason)
        return ORIGINAL["embedding"](input, weight, padding_idx, max_norm, norm_type, scale_grad_by_freq, sparse)
    _count("embedding", None)
    if not _compiling():
        return _eager.embedding(input, weight, padding_idx, bool(scale_grad_by_freq))
    op = _ops.embedding_scaled if scale_grad_by_freq else _ops.embedding
    return op(input, weight, padding_idx)


# ---- attention -------------------------------------------------------------------------------

def scaled_dot_product_attention(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
                                 dropout_p: float = 0.0, is_causal: bool = False, scale: Optional[float] = None,
                                 enable_gqa: bool = False) -> Tensor:
    """``F.scaled_dot_product_attention`` on cukern's kernels when it can: (B, H, S, D) inputs
    of float16/bfloat16 (after autocast), no mask tensor, no dropout, head_dim 32/64/96/128/256,
    grouped-query K/V with ``enable_gqa``, ``is_causal`` with equal query and key lengths
    (PyTorch aligns the causal mask to the top left, cukern to the bottom right: they agree
    only there). PyTorch's otherwise."""
    q, k, v = query, key, value
    reason = None
    if not (q.is_cuda and k.is_cuda and v.is_cuda):
        reason = "not CUDA tensors"
    else:
        dt = _autocast_dtype("scaled_dot_product_attention", q.dtype, q.device)
        q, k, v = _cast(q, dt), _cast(k, dt), _cast(v, dt)
        if attn_mask is not None or dropout_p != 0.0:
            reason = "attn_mask or dropout"
        elif q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
            reason = "shape"
        elif q.dtype not in _HALF or k.dtype != q.dtype or v.dtype != q.dtype:
            reason = f"dtype {q.dtype}"
        elif not (q.device == k.device == v.device):
            reason = "devices differ"
        else:
            b, h, sq, d = q.shape
            bk, hkv, sk, dk = k.shape
            if bk != b or dk != d or d not in _ATTN_HEAD_DIMS:
                reason = "batch or head_dim"
            elif hkv != h and not (enable_gqa and hkv > 0 and h % hkv == 0):
                reason = "heads"
            elif is_causal and sq != sk:
                reason = "causal with seqlen_q != seqlen_k"
            elif b * h > 65535 or sq == 0 or sk == 0:
                reason = "size"
    if reason is not None:
        _count("scaled_dot_product_attention", reason)
        kwargs = {"enable_gqa": True} if enable_gqa else {}
        return ORIGINAL["scaled_dot_product_attention"](query, key, value, attn_mask, dropout_p, is_causal,
                                                        scale=scale, **kwargs)
    _count("scaled_dot_product_attention", None)
    s = _ops.default_scale(q.shape[-1]) if scale is None else float(scale)
    args = (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), bool(is_causal), s)
    out = _ops.attention(*args)[0] if _compiling() else _eager.attention(*args)
    return out.transpose(1, 2)
