"""The eager launch path: one ``torch.autograd.Function`` per op, straight to cukern's array
functions.

Outside ``torch.compile`` this is what the drop-ins call. It computes exactly what the custom
ops in ``_ops`` compute (the same array functions, the same arguments), without the custom-op
dispatch (schema checks, fake-tensor bookkeeping, the autograd wrapper), which costs tens of
microseconds a call: a few milliseconds a training step at 24 layers. Inside a compiled
graph the custom ops are used, since dynamo cannot trace into CuPy launches.

When no input needs a gradient the forward runs without the Function and without saving
statistics.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ..attention import attention as _attention_fwd, attention_backward as _attention_bwd
from ..embedding import embedding as _embedding_fwd, embedding_backward as _embedding_bwd
from ..group_norm import group_norm as _group_norm_fwd, group_norm_backward as _group_norm_bwd
from ..norm import layer_norm as _layer_norm_fwd, layer_norm_backward as _layer_norm_bwd
from ..norm import rms_norm as _rms_norm_fwd, rms_norm_backward as _rms_norm_bwd


def _needs_grad(*tensors: Optional[Tensor]) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _keep(grad: Optional[Tensor], needed: bool) -> Optional[Tensor]:
    return grad if needed else None


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        y, mean, rstd = _layer_norm_fwd(x, weight, bias, eps, return_stats=True)
        ctx.save_for_backward(x, weight, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = _layer_norm_bwd(dy, x, weight, mean, rstd)
        need = ctx.needs_input_grad
        return _keep(dx, need[0]), _keep(dw, need[1]), _keep(db, need[2]), None


def layer_norm(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float) -> Tensor:
    """x (*, D); weight, bias (D,) or None -> y (*, D) contiguous."""
    if _needs_grad(x, weight, bias):
        return _LayerNorm.apply(x, weight, bias, eps)
    return _layer_norm_fwd(x, weight, bias, eps)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = _rms_norm_fwd(x, weight, eps, return_stats=True)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = _rms_norm_bwd(dy, x, weight, rstd)
        need = ctx.needs_input_grad
        return _keep(dx, need[0]), _keep(dw, need[1]), None


def rms_norm(x: Tensor, weight: Optional[Tensor], eps: float) -> Tensor:
    """x (*, D); weight (D,) or None -> y (*, D) contiguous."""
    if _needs_grad(x, weight):
        return _RMSNorm.apply(x, weight, eps)
    return _rms_norm_fwd(x, weight, eps)


class _GroupNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, num_groups, weight, bias, eps):
        y, mean, rstd = _group_norm_fwd(x, num_groups, weight, bias, eps, return_stats=True)
        ctx.save_for_backward(x, weight, mean, rstd)
        ctx.num_groups = num_groups
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = _group_norm_bwd(dy, x, ctx.num_groups, weight, mean, rstd)
        need = ctx.needs_input_grad
        return _keep(dx, need[0]), None, _keep(dw, need[2]), _keep(db, need[3]), None


def group_norm(x: Tensor, num_groups: int, weight: Optional[Tensor], bias: Optional[Tensor],
               eps: float) -> Tensor:
    """x (N, C, *S) contiguous or channels-last -> y in x's layout."""
    if _needs_grad(x, weight, bias):
        return _GroupNorm.apply(x, num_groups, weight, bias, eps)
    return _group_norm_fwd(x, num_groups, weight, bias, eps)


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, indices, weight, padding_idx, scale_grad_by_freq):
        ctx.save_for_backward(indices)
        ctx.num_embeddings, ctx.padding_idx, ctx.scale = weight.shape[0], padding_idx, scale_grad_by_freq
        return _embedding_fwd(indices, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad):
        (indices,) = ctx.saved_tensors
        dw = _embedding_bwd(grad, indices, ctx.num_embeddings, ctx.padding_idx, ctx.scale)
        return None, dw, None, None


def embedding(indices: Tensor, weight: Tensor, padding_idx: Optional[int], scale_grad_by_freq: bool) -> Tensor:
    """indices (*) int32/int64, weight (V, D) -> (*, D)."""
    if _needs_grad(weight):
        return _Embedding.apply(indices, weight, padding_idx, scale_grad_by_freq)
    return _embedding_fwd(indices, weight, padding_idx)


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        out, lse = _attention_fwd(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = _attention_bwd(dout, q, k, v, out, lse, causal=ctx.causal, softmax_scale=ctx.scale,
                                    deterministic=torch.are_deterministic_algorithms_enabled())
        need = ctx.needs_input_grad
        return _keep(dq, need[0]), _keep(dk, need[1]), _keep(dv, need[2]), None, None


def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> Tensor:
    """q (B, Sq, H, D), k and v (B, Sk, Hkv, D) -> out (B, Sq, H, D) contiguous."""
    if _needs_grad(q, k, v):
        return _Attention.apply(q, k, v, causal, scale)
    return _attention_fwd(q, k, v, causal=causal, softmax_scale=scale)
