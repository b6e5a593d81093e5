"""The MoE block as one call, forward and backward, composed of the family's kernels: the
router's logits (the framework's matrix product), ``moe_router``, ``moe_permute``, the grouped
up-projection, the gated activation (``cukern.swiglu`` / ``cukern.geglu`` on the two halves read
in place), the grouped down-projection and ``moe_unpermute``. No call reads a count on the host.

Shapes, as ``cukern.moe.reference.moe`` and transformers' fused experts: x (T, H) float16 or
bfloat16; router_w (E, H); w_gate_up (E, 2I, H), the gate's I rows first; w_down (E, H, I); all
of x's dtype and framework (CuPy arrays or torch CUDA tensors); H and 2I multiples of 8."""
from __future__ import annotations

from dataclasses import dataclass

from .. import _arrays
from ..swiglu import geglu, geglu_backward, swiglu, swiglu_backward
from . import reference
from .grouped_mm import moe_grouped_mm, moe_grouped_mm_backward
from .routing import (moe_permute, moe_permute_backward, moe_router, moe_router_backward, moe_unpermute,
                      moe_unpermute_backward)

ACTS = reference.ACTS   # "silu" (SwiGLU: Mixtral, Qwen3-MoE, OLMoE), "gelu", "gelu_tanh"


@dataclass
class MoESaved:
    """What ``moe_forward`` keeps for ``moe_backward``: the router's logits (T, E) and its
    choice (weights (T, k) float32, experts (T, k) int32), the permutation (x_perm (T k, H),
    row_of (T k,), offsets (E + 1,)), and the experts' intermediates (h (T k, 2I) and y (T k,
    H); the gate's output is computed again from h in the backward)."""
    logits: object
    weights: object
    experts: object
    x_perm: object
    row_of: object
    offsets: object
    h: object
    y: object
    top_k: int
    act: str
    score: str
    renormalize: bool
    scale: float


def _act(act):
    if act not in ACTS:
        raise ValueError(f"act: expected one of {', '.join(map(repr, ACTS))}, got {act!r}")
    return act


def _check(x, router_w, w_gate_up, w_down) -> tuple[int, int, int]:
    """(H, E, I), or a ValueError naming the argument."""
    xa = _arrays.as_device_array(x, "x")
    ra, ga, da = (_arrays.as_device_array(a, n) for a, n in ((router_w, "router_w"), (w_gate_up, "w_gate_up"),
                                                              (w_down, "w_down")))
    if xa.ndim != 2:
        raise ValueError(f"x: expected (tokens, hidden), got shape {xa.shape}")
    h = xa.shape[1]
    if ra.ndim != 2 or ra.shape[1] != h:
        raise ValueError(f"router_w: shape {ra.shape}; expected (experts, {h})")
    e = ra.shape[0]
    if ga.ndim != 3 or ga.shape[0] != e or ga.shape[2] != h or ga.shape[1] % 2:
        raise ValueError(f"w_gate_up: shape {ga.shape}; expected ({e}, 2 * intermediate, {h})")
    i = ga.shape[1] // 2
    if da.shape != (e, h, i):
        raise ValueError(f"w_down: shape {da.shape}; expected {(e, h, i)}")
    for a in (ra, ga, da):
        if a.dtype != xa.dtype:
            raise ValueError(f"{a.name}: dtype {a.dtype}, expected x's {xa.dtype}")
    if h % 8 or i % 8:
        raise ValueError(f"w_gate_up: hidden {h} and intermediate {i} must be multiples of 8 (the products move "
                         "16-byte vectors)")
    return h, e, i


def _gate(act: str, gate, up):
    if act == "silu":
        return swiglu(gate, up)
    return geglu(gate, up, approximate="tanh" if act == "gelu_tanh" else "none")


def _gate_backward(act: str, dz, gate, up):
    if act == "silu":
        return swiglu_backward(dz, gate, up)
    return geglu_backward(dz, gate, up, approximate="tanh" if act == "gelu_tanh" else "none")


def _matmul(a, b):
    """``a @ b``, the framework's own product (cuBLAS). A seam for the sanitizer's initcheck
    processes (tests/sanitize_cases.py), which replace it: initcheck does not register cuBLAS's
    stores on Hopper, so it reports every read of a cuBLAS product, PyTorch's own kernels' too."""
    return a @ b


def _torch(a) -> bool:
    return type(a).__module__.split(".")[0] == "torch"


def _array_module(a):
    """CuPy, or NumPy for the host arrays that stand in for device ones in the tests' dry runs."""
    import importlib

    return importlib.import_module("numpy" if type(a).__module__.split(".")[0] == "numpy" else "cupy")


def _contiguous(a):
    return a.contiguous() if _torch(a) else _array_module(a).ascontiguousarray(a)


def _cat_columns(a, b):
    """[a | b] along the columns, in a's framework."""
    if _torch(a):
        import torch

        return torch.cat([a, b], dim=1)
    return _array_module(a).concatenate([a, b], axis=1)


def _experts_forward(x, experts, weights, w_gate_up, w_down, act: str):
    """The experts' part of the block, from the router's choice: ``(out, x_perm, row_of, offsets,
    h, y)``. The gate's output goes straight into the down projection (the backward computes it
    again from h)."""
    i = w_gate_up.shape[1] // 2
    x_perm, _, row_of, offsets, _ = moe_permute(x, experts, w_gate_up.shape[0])
    h = moe_grouped_mm(x_perm, w_gate_up, offsets)
    y = moe_grouped_mm(_gate(act, h[:, :i], h[:, i:]), w_down, offsets)
    return moe_unpermute(y, row_of, weights), x_perm, row_of, offsets, h, y


def _experts_backward(dout, x_perm, row_of, offsets, h, y, weights, w_gate_up, w_down, act: str, top_k: int):
    """Gradients of ``_experts_forward``: ``(dx, d weights (float32), dw_gate_up, dw_down)``.
    Each intermediate is let go once used: the peak is the last product's (dh, both weight
    gradients, dx_perm, beside what the forward kept)."""
    i = h.shape[1] // 2
    dy, dweights = moe_unpermute_backward(_contiguous(dout), y, row_of, weights)
    dz, dw_down = moe_grouped_mm_backward(dy, _gate(act, h[:, :i], h[:, i:]), w_down, offsets)
    del dy
    dgate, dup = _gate_backward(act, dz, h[:, :i], h[:, i:])
    del dz
    dh = _cat_columns(dgate, dup)
    del dgate, dup
    dx_perm, dw_gate_up = moe_grouped_mm_backward(dh, x_perm, w_gate_up, offsets)
    del dh
    return moe_permute_backward(dx_perm, row_of, top_k), dweights, dw_gate_up, dw_down


def moe_forward(x, router_w, w_gate_up, w_down, top_k: int, *, act: str = "silu", score: str = "softmax",
                renormalize: bool = True, selection_bias=None, scale: float = 1.0):
    """The MoE block: ``(out (T, H) in x's dtype, MoESaved)``, as ``cukern.moe.reference.moe``.

    Args:
        x, router_w, w_gate_up, w_down: as the module's docstring.
        top_k: experts a token. act: "silu", "gelu" or "gelu_tanh" on the gate half.
        score, renormalize, selection_bias, scale: the router's (``moe_router``).

    The logits are ``x @ router_w.T`` in x's dtype (as an nn.Linear router under autocast); the
    products accumulate in float32 and round once each; the combine sums in float32.
    """
    _act(act)
    _check(x, router_w, w_gate_up, w_down)
    logits = _matmul(x, router_w.T)
    weights, experts, _ = moe_router(logits, top_k, score=score, renormalize=renormalize,
                                     selection_bias=selection_bias, scale=scale)
    out, x_perm, row_of, offsets, h, y = _experts_forward(x, experts, weights, w_gate_up, w_down, act)
    return out, MoESaved(logits, weights, experts, x_perm, row_of, offsets, h, y, top_k, act, score,
                         bool(renormalize), scale)


def moe_backward(dout, x, router_w, w_gate_up, w_down, saved: MoESaved, dlogits_extra=None):
    """Gradients of ``moe_forward``: ``(dx, drouter_w, dw_gate_up, dw_down)`` in x's dtype, as
    ``cukern.moe.reference.moe_backward`` (the choice of experts held fixed). ``dout`` (T, H) of
    x's dtype; ``dlogits_extra`` (T, E) of the logits' dtype (x's) or None: the auxiliary losses'
    gradient with respect to the logits, added before the router's product."""
    if dlogits_extra is not None and (tuple(dlogits_extra.shape) != tuple(saved.logits.shape)
                                      or dlogits_extra.dtype != saved.logits.dtype):
        raise ValueError(f"dlogits_extra: shape {tuple(dlogits_extra.shape)} {dlogits_extra.dtype}; expected "
                         f"{tuple(saved.logits.shape)} {saved.logits.dtype}, the logits'")
    dx, dweights, dw_gate_up, dw_down = _experts_backward(dout, saved.x_perm, saved.row_of, saved.offsets, saved.h,
                                                          saved.y, saved.weights, w_gate_up, w_down, saved.act,
                                                          saved.top_k)
    dlogits = moe_router_backward(dweights, saved.logits, saved.experts, score=saved.score,
                                  renormalize=saved.renormalize, scale=saved.scale)
    if dlogits_extra is not None:
        dlogits = dlogits + dlogits_extra
    return dx + _matmul(dlogits, router_w), _matmul(dlogits.T, x), dw_gate_up, dw_down
