"""The experts of an MoE block under PyTorch's autograd: transformers' fused experts' forward
(the model's own router chooses; this computes what its experts compute) on the family's
kernels, forward and backward."""
from __future__ import annotations

import torch

from .block import _act, _gate, _gate_backward
from .grouped_mm import moe_grouped_mm, moe_grouped_mm_backward
from .routing import moe_permute, moe_permute_backward, moe_unpermute, moe_unpermute_backward


class _Experts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, top_k_index, top_k_weights, w_gate_up, w_down, act):
        experts = top_k_index.to(torch.int32).contiguous()
        weights = top_k_weights.float().contiguous()
        i = w_gate_up.shape[1] // 2
        x_perm, _, row_of, offsets, _ = moe_permute(x.contiguous(), experts, w_gate_up.shape[0])
        h = moe_grouped_mm(x_perm, w_gate_up.contiguous(), offsets)
        z = _gate(act, h[:, :i], h[:, i:])
        y = moe_grouped_mm(z, w_down.contiguous(), offsets)
        ctx.save_for_backward(x_perm, row_of, offsets, h, z, y, weights, w_gate_up, w_down)
        ctx.act, ctx.top_k, ctx.weights_dtype = act, experts.shape[1], top_k_weights.dtype
        return moe_unpermute(y, row_of, weights)

    @staticmethod
    def backward(ctx, dout):
        x_perm, row_of, offsets, h, z, y, weights, w_gate_up, w_down = ctx.saved_tensors
        i = h.shape[1] // 2
        dy, dweights = moe_unpermute_backward(dout.contiguous(), y, row_of, weights)
        dz, dw_down = moe_grouped_mm_backward(dy, z, w_down.contiguous(), offsets)
        dgate, dup = _gate_backward(ctx.act, dz, h[:, :i], h[:, i:])
        dx_perm, dw_gate_up = moe_grouped_mm_backward(torch.cat([dgate, dup], dim=1), x_perm,
                                                      w_gate_up.contiguous(), offsets)
        dx = moe_permute_backward(dx_perm, row_of, ctx.top_k)
        return dx, None, dweights.to(ctx.weights_dtype), dw_gate_up, dw_down, None


def moe_experts(x, top_k_index, top_k_weights, w_gate_up, w_down, act: str = "silu"):
    """transformers' fused experts on the kernels, with autograd.

    Args:
        x: (T, H) float16 or bfloat16 CUDA tensor: the tokens.
        top_k_index: (T, k) integer: each token's experts (the model's router's choice).
        top_k_weights: (T, k) float: their weights (the gradient flows back to the router).
        w_gate_up: (E, 2I, H), x's dtype: each expert's gate rows then up rows.
        w_down: (E, H, I), x's dtype.
        act: "silu", "gelu" or "gelu_tanh" on the gate half.

    Returns:
        (T, H) in x's dtype: each token's experts' outputs times their weights, summed in float32.
    """
    return _Experts.apply(x, top_k_index, top_k_weights, w_gate_up, w_down, _act(act))
