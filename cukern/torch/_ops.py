"""cukern's kernels as PyTorch custom ops (``torch.ops.cukern.*``): schema, fake (meta)
implementations for torch.compile, and autograd formulas, so they run under autograd and
inside compiled graphs without graph breaks.

Each op takes and returns plain tensors; optional weights are ``Tensor?`` and gradients that
do not exist come back as 0-element tensors (custom ops cannot return None), turned into
None by the autograd formulas. The array functions of ``cukern`` do the work (on torch's
current stream, on the tensors' device).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

# (the functions: cukern's package namespace binds these names to them, not to the modules)
from ..attention import attention as _attention_fwd, attention_backward as _attention_bwd
from ..embedding import embedding as _embedding_fwd, embedding_backward as _embedding_bwd
from ..group_norm import group_norm as _group_norm_fwd, group_norm_backward as _group_norm_bwd
from ..norm import layer_norm as _layer_norm_fwd, layer_norm_backward as _layer_norm_bwd
from ..norm import rms_norm as _rms_norm_fwd, rms_norm_backward as _rms_norm_bwd

_LIB = "cukern"


def _none(t: Tensor) -> Tensor:
    """The 0-element placeholder for an absent gradient."""
    return t.new_empty((0,))


def _grad_or_none(g: Tensor, present: bool) -> Optional[Tensor]:
    return g if present else None


# ---- layer_norm ------------------------------------------------------------------------------

@torch.library.custom_op(f"{_LIB}::layer_norm", mutates_args=())
def layer_norm(x: Tensor, weight: Optional[Tensor], bias: Optional[Tensor], eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """y (x's shape, contiguous), mean and rstd (float32, x.shape[:-1]) over the last axis."""
    return _layer_norm_fwd(x, weight, bias, eps, return_stats=True)


@layer_norm.register_fake
def _(x, weight, bias, eps):
    stats = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return torch.empty_like(x, memory_format=torch.contiguous_format), stats, torch.empty_like(stats)


@torch.library.custom_op(f"{_LIB}::layer_norm_backward", mutates_args=())
def layer_norm_backward(dy: Tensor, x: Tensor, weight: Optional[Tensor], mean: Tensor, rstd: Tensor,
                        ) -> tuple[Tensor, Tensor, Tensor]:
    dx, dw, db = _layer_norm_bwd(dy, x, weight, mean, rstd)
    return dx, (dw if dw is not None else _none(x)), db


@layer_norm_backward.register_fake
def _(dy, x, weight, mean, rstd):
    d = x.shape[-1]
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            x.new_empty((d,)) if weight is not None else x.new_empty((0,)), x.new_empty((d,)))


def _layer_norm_setup(ctx, inputs, output):
    x, weight, bias, eps = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.has_weight, ctx.has_bias = weight is not None, bias is not None
    ctx.mark_non_differentiable(mean, rstd)


def _layer_norm_grad(ctx, dy, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = layer_norm_backward(dy, x, weight, mean, rstd)
    return dx, _grad_or_none(dw, ctx.has_weight), _grad_or_none(db, ctx.has_bias), None


layer_norm.register_autograd(_layer_norm_grad, setup_context=_layer_norm_setup)


# ---- rms_norm --------------------------------------------------------------------------------

@torch.library.custom_op(f"{_LIB}::rms_norm", mutates_args=())
def rms_norm(x: Tensor, weight: Optional[Tensor], eps: float) -> tuple[Tensor, Tensor]:
    """y (x's shape, contiguous) and rstd (float32, x.shape[:-1]) over the last axis."""
    return _rms_norm_fwd(x, weight, eps, return_stats=True)


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op(f"{_LIB}::rms_norm_backward", mutates_args=())
def rms_norm_backward(dy: Tensor, x: Tensor, weight: Optional[Tensor], rstd: Tensor) -> tuple[Tensor, Tensor]:
    dx, dw = _rms_norm_bwd(dy, x, weight, rstd)
    return dx, (dw if dw is not None else _none(x))


@rms_norm_backward.register_fake
def _(dy, x, weight, rstd):
    return (torch.empty_like(x, memory_format=torch.contiguous_format),
            x.new_empty((x.shape[-1],) if weight is not None else (0,)))


def _rms_norm_setup(ctx, inputs, output):
    x, weight, eps = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.has_weight = weight is not None
    ctx.mark_non_differentiable(output[1])


def _rms_norm_grad(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_backward(dy, x, weight, rstd)
    return dx, _grad_or_none(dw, ctx.has_weight), None


rms_norm.register_autograd(_rms_norm_grad, setup_context=_rms_norm_setup)


# ---- group_norm ------------------------------------------------------------------------------

def _like_layout(x: Tensor) -> Tensor:
    """An empty tensor in the layout the kernels give x's outputs: contiguous when x is
    (size-1 axes aside), else channels-last (the front hands the op nothing else)."""
    if x.is_contiguous() or x.dim() < 3:
        return torch.empty_like(x, memory_format=torch.contiguous_format)
    stored = x.new_empty([x.shape[0], *x.shape[2:], x.shape[1]])
    return stored.permute(0, x.dim() - 1, *range(1, x.dim() - 1))


@torch.library.custom_op(f"{_LIB}::group_norm", mutates_args=())
def group_norm(x: Tensor, num_groups: int, weight: Optional[Tensor], bias: Optional[Tensor], eps: float,
               ) -> tuple[Tensor, Tensor, Tensor]:
    """y (x's shape and layout), mean and rstd (float32, (N, num_groups))."""
    return _group_norm_fwd(x, num_groups, weight, bias, eps, return_stats=True)


@group_norm.register_fake
def _(x, num_groups, weight, bias, eps):
    stats = x.new_empty((x.shape[0], num_groups), dtype=torch.float32)
    return _like_layout(x), stats, torch.empty_like(stats)


@torch.library.custom_op(f"{_LIB}::group_norm_backward", mutates_args=())
def group_norm_backward(dy: Tensor, x: Tensor, num_groups: int, weight: Optional[Tensor], mean: Tensor,
                        rstd: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    dx, dw, db = _group_norm_bwd(dy, x, num_groups, weight, mean, rstd)
    return dx, (dw if dw is not None else _none(x)), db


@group_norm_backward.register_fake
def _(dy, x, num_groups, weight, mean, rstd):
    c = x.shape[1]
    return _like_layout(x), x.new_empty((c,) if weight is not None else (0,)), x.new_empty((c,))


def _group_norm_setup(ctx, inputs, output):
    x, num_groups, weight, bias, eps = inputs
    _, mean, rstd = output
    ctx.save_for_backward(x, weight, mean, rstd)
    ctx.num_groups, ctx.has_weight, ctx.has_bias = num_groups, weight is not None, bias is not None
    ctx.mark_non_differentiable(mean, rstd)


def _group_norm_grad(ctx, dy, _dmean, _drstd):
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = group_norm_backward(dy, x, ctx.num_groups, weight, mean, rstd)
    return dx, None, _grad_or_none(dw, ctx.has_weight), _grad_or_none(db, ctx.has_bias), None


group_norm.register_autograd(_group_norm_grad, setup_context=_group_norm_setup)


# ---- embedding -------------------------------------------------------------------------------

@torch.library.custom_op(f"{_LIB}::embedding", mutates_args=())
def embedding(indices: Tensor, weight: Tensor, padding_idx: Optional[int]) -> Tensor:
    """weight[indices]: (*indices.shape, D), contiguous."""
    return _embedding_fwd(indices, weight, padding_idx)


def _embedding_fake(indices, weight, padding_idx):
    return weight.new_empty((*indices.shape, weight.shape[1]))


embedding.register_fake(_embedding_fake)


@torch.library.custom_op(f"{_LIB}::embedding_backward", mutates_args=())
def embedding_backward(grad: Tensor, indices: Tensor, num_embeddings: int, padding_idx: Optional[int],
                       scale_grad_by_freq: bool) -> Tensor:
    return _embedding_bwd(grad, indices, num_embeddings, padding_idx, scale_grad_by_freq)


@embedding_backward.register_fake
def _(grad, indices, num_embeddings, padding_idx, scale_grad_by_freq):
    return grad.new_empty((num_embeddings, grad.shape[-1]))


def _embedding_setup(ctx, inputs, output):
    indices, weight, padding_idx = inputs
    ctx.save_for_backward(indices)
    ctx.num_embeddings, ctx.padding_idx = weight.shape[0], padding_idx


def _embedding_grad(ctx, grad):
    (indices,) = ctx.saved_tensors
    dw = embedding_backward(grad, indices, ctx.num_embeddings, ctx.padding_idx, False)
    return None, dw, None


embedding.register_autograd(_embedding_grad, setup_context=_embedding_setup)


@torch.library.custom_op(f"{_LIB}::embedding_scaled", mutates_args=())
def embedding_scaled(indices: Tensor, weight: Tensor, padding_idx: Optional[int]) -> Tensor:
    """``embedding`` whose gradient is scaled by the inverse frequency of each index
    (``scale_grad_by_freq=True``)."""
    return _embedding_fwd(indices, weight, padding_idx)


embedding_scaled.register_fake(_embedding_fake)


def _embedding_scaled_grad(ctx, grad):
    (indices,) = ctx.saved_tensors
    return None, embedding_backward(grad, indices, ctx.num_embeddings, ctx.padding_idx, True), None


embedding_scaled.register_autograd(_embedding_scaled_grad, setup_context=_embedding_setup)


# ---- attention -------------------------------------------------------------------------------

@torch.library.custom_op(f"{_LIB}::attention", mutates_args=())
def attention(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float) -> tuple[Tensor, Tensor]:
    """q (B, Sq, H, D), k and v (B, Sk, Hkv, D) -> out (B, Sq, H, D) contiguous and the
    log-sum-exp (B, H, Sq) float32."""
    return _attention_fwd(q, k, v, causal=causal, softmax_scale=scale, return_lse=True)


@attention.register_fake
def _(q, k, v, causal, scale):
    b, sq, h, _ = q.shape
    return torch.empty_like(q, memory_format=torch.contiguous_format), q.new_empty((b, h, sq), dtype=torch.float32)


@torch.library.custom_op(f"{_LIB}::attention_backward", mutates_args=())
def attention_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                       scale: float, deterministic: bool) -> tuple[Tensor, Tensor, Tensor]:
    return _attention_bwd(dout, q, k, v, out, lse, causal=causal, softmax_scale=scale,
                                         deterministic=deterministic)


@attention_backward.register_fake
def _(dout, q, k, v, out, lse, causal, scale, deterministic):
    c = torch.contiguous_format
    return torch.empty_like(q, memory_format=c), torch.empty_like(k, memory_format=c), torch.empty_like(v, memory_format=c)


def _attention_setup(ctx, inputs, output):
    q, k, v, causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal, ctx.scale = causal, scale
    ctx.mark_non_differentiable(lse)


def _attention_grad(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    deterministic = torch.are_deterministic_algorithms_enabled()
    dq, dk, dv = attention_backward(dout, q, k, v, out, lse, ctx.causal, ctx.scale, deterministic)
    return dq, dk, dv, None, None


attention.register_autograd(_attention_grad, setup_context=_attention_setup)


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
