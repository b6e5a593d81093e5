"""The experts of an MoE block under PyTorch: transformers' fused experts' forward (the model's
own router chooses; this computes what its experts compute) on the family's kernels, forward and
backward, as the family's ``moe_experts`` op (``cukern.torch`` builds its autograd Function and
its custom op, ``torch.ops.cukern.moe_experts``, from the declaration in ``cukern/moe/__init__.py``).
Imported when the op first runs: it imports torch."""
from __future__ import annotations

import torch

from .biased_glu import moe_biased_glu, moe_biased_glu_backward, moe_group_bias
from .block import ACTS, MoESaved, _experts_backward, _experts_forward, moe_backward, moe_forward
from .reference import SCORES
from .grouped_mm import moe_grouped_mm, moe_grouped_mm_backward
from .routing import moe_permute, moe_permute_backward, moe_unpermute, moe_unpermute_backward


def experts_forward(x, top_k_index, top_k_weights, w_gate_up, w_down, act: int):
    """(out (T, H), then what the backward needs: x_perm (T k, H), row_of (T k,) int32, offsets
    (E + 1,) int32, h (T k, 2I), y (T k, H), the weights (T, k) in float32). The gate's output z
    (T k, I), half h's size, is not kept: the backward computes it again from h (the same kernel,
    the same bits)."""
    experts = top_k_index.to(torch.int32).contiguous()
    # (a copy even of float32 weights: a custom op's output must not be one of its inputs)
    weights = top_k_weights.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    return (*_experts_forward(x.contiguous(), experts, weights, w_gate_up.contiguous(), w_down.contiguous(),
                              ACTS[act]), weights)


def experts_backward(dout, x_perm, row_of, offsets, h, y, weights, w_gate_up, w_down, act: int, top_k: int):
    """(dx (T, H), d weights (T, k) float32, d w_gate_up, d w_down)."""
    return _experts_backward(dout, x_perm, row_of, offsets, h, y, weights, w_gate_up.contiguous(),
                             w_down.contiguous(), ACTS[act], top_k)


def _experts_outputs_fake(x, top_k_index, top_k_weights, experts: int, two_i: int):
    """The shapes of both experts ops' forward outputs: out, x_perm, row_of, offsets, h, y, the
    float32 weights."""
    pairs = top_k_index.shape[0] * top_k_index.shape[1]
    rows = lambda n, dt=x.dtype: x.new_empty((pairs, n), dtype=dt)   # noqa: E731
    return (x.new_empty(x.shape), rows(x.shape[1]), x.new_empty((pairs,), dtype=torch.int32),
            x.new_empty((experts + 1,), dtype=torch.int32), rows(two_i), rows(x.shape[1]),
            x.new_empty(tuple(top_k_weights.shape), dtype=torch.float32))


def experts_fake(x, top_k_index, top_k_weights, w_gate_up, w_down, act):
    return _experts_outputs_fake(x, top_k_index, top_k_weights, w_gate_up.shape[0], w_gate_up.shape[1])


def experts_backward_fake(dout, x_perm, row_of, offsets, h, y, weights, w_gate_up, w_down, act, top_k):
    return (dout.new_empty(dout.shape), weights.new_empty(weights.shape), w_gate_up.new_empty(w_gate_up.shape),
            w_down.new_empty(w_down.shape))


# ---- biased experts with weights held (E, in, out): GPT-OSS's -------------------------------------

def _bias(b, dtype):
    """A bias as the kernels read it: float32 or the rows' dtype, contiguous."""
    return (b if b.dtype in (torch.float32, dtype) else b.float()).contiguous()


def _pair_bias_grad(dout, row_of, offsets, weights, experts: int):
    """d b_down (E, H) float64: each expert's pairs' weights times their tokens' dout, summed
    from the float32 weights and dout as given (a sum of dy's rounded rows would be a rounding
    worse than PyTorch's float32 sum; float64 keeps TF32 out of the product)."""
    t, k = weights.shape
    pair_e = torch.searchsorted(offsets[1:], row_of, right=True).view(t, k)   # (E: after the last expert)
    per_token = (torch.nn.functional.one_hot(pair_e, experts + 1)[..., :experts] * weights[..., None].double()).sum(1)
    return per_token.T @ dout.double()


def check_biased_experts(x, top_k_index, top_k_weights, w_gate_up, b_gate_up, w_down, b_down, alpha, limit):
    """A ValueError naming the argument where GPT-OSS's experts' arguments do not fit together."""
    if x.dim() != 2:
        raise ValueError(f"x: expected (tokens, hidden), got shape {tuple(x.shape)}")
    t, h = x.shape
    if top_k_index.dim() != 2 or top_k_index.shape[0] != t:
        raise ValueError(f"top_k_index: shape {tuple(top_k_index.shape)}; expected ({t}, top_k)")
    if tuple(top_k_weights.shape) != tuple(top_k_index.shape):
        raise ValueError(f"top_k_weights: shape {tuple(top_k_weights.shape)}; expected top_k_index's "
                         f"{tuple(top_k_index.shape)}")
    if w_gate_up.dim() != 3 or w_gate_up.shape[1] != h or w_gate_up.shape[2] % 2:
        raise ValueError(f"w_gate_up: shape {tuple(w_gate_up.shape)}; expected (experts, {h}, 2 * intermediate)")
    e, two_i = w_gate_up.shape[0], w_gate_up.shape[2]
    for name, a, want in (("b_gate_up", b_gate_up, (e, two_i)), ("w_down", w_down, (e, two_i // 2, h)),
                          ("b_down", b_down, (e, h))):
        if tuple(a.shape) != want:
            raise ValueError(f"{name}: shape {tuple(a.shape)}; expected {want}")
    for name, a in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if a.dtype != x.dtype:
            raise ValueError(f"{name}: dtype {a.dtype}, expected x's {x.dtype}")
    for name, a in (("b_gate_up", b_gate_up), ("b_down", b_down)):
        if a.dtype not in (torch.float32, x.dtype):
            raise ValueError(f"{name}: dtype {a.dtype}, expected float32 or x's {x.dtype}")
    for name, v in (("alpha", alpha), ("limit", limit)):
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < float("inf")):
            raise ValueError(f"{name}: must be a positive finite number, got {v!r}")


def biased_experts_forward(x, top_k_index, top_k_weights, w_gate_up, b_gate_up, w_down, b_down, alpha: float,
                           limit: float):
    """GPT-OSS's experts: (out (T, H), then what the backward needs: x_perm (T k, H), row_of,
    offsets, h (T k, 2I) before the bias, z (T k, I), y (T k, H) with its bias, the weights (T,
    k) float32). w_gate_up (E, H, 2I) (gate and up columns interleaved), b_gate_up (E, 2I),
    w_down (E, I, H), b_down (E, H)."""
    experts = top_k_index.to(torch.int32).contiguous()
    weights = top_k_weights.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
    x_perm, _, row_of, offsets, _ = moe_permute(x.contiguous(), experts, w_gate_up.shape[0])
    h = moe_grouped_mm(x_perm, w_gate_up.contiguous(), offsets, b_layout="kn")
    z = moe_biased_glu(h, _bias(b_gate_up, x.dtype), offsets, alpha, limit)
    y = moe_group_bias(moe_grouped_mm(z, w_down.contiguous(), offsets, b_layout="kn"), _bias(b_down, x.dtype),
                       offsets)
    return moe_unpermute(y, row_of, weights), x_perm, row_of, offsets, h, y, weights


def biased_experts_backward(dout, x_perm, row_of, offsets, h, y, weights, w_gate_up, b_gate_up, w_down, b_down,
                            alpha: float, limit: float, top_k: int):
    """(dx (T, H), d weights (T, k) float32, d w_gate_up, d b_gate_up, d w_down, d b_down); the
    gate's output computed again from h."""
    dy, dweights = moe_unpermute_backward(dout.contiguous(), y, row_of, weights)
    bias = _bias(b_gate_up, h.dtype)
    z = moe_biased_glu(h, bias, offsets, alpha, limit)
    dz, dw_down = moe_grouped_mm_backward(dy, z, w_down.contiguous(), offsets, b_layout="kn")
    del z, dy   # (each intermediate let go once used: the peak is the last product's)
    dh, db_gate_up = moe_biased_glu_backward(dz, h, bias, offsets, alpha, limit)
    del dz
    dx_perm, dw_gate_up = moe_grouped_mm_backward(dh, x_perm, w_gate_up.contiguous(), offsets, b_layout="kn")
    del dh
    db_down = _pair_bias_grad(dout, row_of, offsets, weights, w_down.shape[0])
    return (moe_permute_backward(dx_perm, row_of, top_k), dweights, dw_gate_up, db_gate_up.to(b_gate_up.dtype),
            dw_down, db_down.to(b_down.dtype))


def biased_experts_fake(x, top_k_index, top_k_weights, w_gate_up, b_gate_up, w_down, b_down, alpha, limit):
    return _experts_outputs_fake(x, top_k_index, top_k_weights, w_gate_up.shape[0], w_gate_up.shape[2])


def biased_experts_backward_fake(dout, x_perm, row_of, offsets, h, y, weights, w_gate_up, b_gate_up, w_down,
                                 b_down, alpha, limit, top_k):
    return (dout.new_empty(dout.shape), weights.new_empty(weights.shape),
            *(a.new_empty(a.shape) for a in (w_gate_up, b_gate_up, w_down, b_down)))


# ---- the block: router, experts and combine as one op -------------------------------------------

def block_forward(x, router_w, w_gate_up, w_down, selection_bias, top_k: int, act: int, score: int,
                  renormalize: bool, scale: float):
    """(out (T, H), logits (T, E): both visible; then what the backward needs: the weights (T, k)
    float32, the experts (T, k) int32, x_perm, row_of, offsets, h, y)."""
    out, s = moe_forward(x.contiguous(), router_w.contiguous(), w_gate_up.contiguous(), w_down.contiguous(), top_k,
                         act=ACTS[act], score=SCORES[score], renormalize=renormalize,
                         selection_bias=selection_bias, scale=scale)
    return out, s.logits, s.weights, s.experts, s.x_perm, s.row_of, s.offsets, s.h, s.y


def block_backward(dout, dlogits, x, router_w, w_gate_up, w_down, logits, weights, experts, x_perm, row_of, offsets,
                   h, y, top_k: int, act: int, score: int, renormalize: bool, scale: float):
    """(dx, d router_w, d w_gate_up, d w_down), the choice of experts held fixed; ``dlogits`` (the
    auxiliary losses' gradient reaching the visible logits, or None) joins the router's."""
    saved = MoESaved(logits, weights, experts, x_perm, row_of, offsets, h, y, top_k, ACTS[act], SCORES[score],
                     renormalize, scale)
    return moe_backward(dout, x.contiguous(), router_w.contiguous(), w_gate_up.contiguous(), w_down.contiguous(), saved,
                        dlogits_extra=dlogits)


def block_fake(x, router_w, w_gate_up, w_down, selection_bias, top_k, act, score, renormalize, scale):
    t, e, two_i = x.shape[0], router_w.shape[0], w_gate_up.shape[1]
    pairs = t * top_k
    return (x.new_empty(x.shape), x.new_empty((t, e)), x.new_empty((t, top_k), dtype=torch.float32),
            x.new_empty((t, top_k), dtype=torch.int32), x.new_empty((pairs, x.shape[1])),
            x.new_empty((pairs,), dtype=torch.int32), x.new_empty((e + 1,), dtype=torch.int32),
            x.new_empty((pairs, two_i)), x.new_empty((pairs, x.shape[1])))


def block_backward_fake(dout, dlogits, x, router_w, w_gate_up, w_down, *rest):
    return tuple(a.new_empty(a.shape) for a in (x, router_w, w_gate_up, w_down))
