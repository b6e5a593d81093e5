"""The norms under ``cukern.torch``: custom ops, the drop-ins' routes, the variants (offset,
casting modes) and the fused residual as modules and functions."""
from __future__ import annotations

import math

from .._family import TorchOp
from .backward import layer_norm_backward, rms_norm_backward
from .configs import CASTING_MODES
from .forward import _casting, _offset, layer_norm, rms_norm

# ---- PyTorch bindings -------------------------------------------------------------------------
# The ops carry the variants as arguments (offset: a float; casting: CASTING_MODES' int), so
# that one op serves the drop-ins (0.0, 0) and the modules' options. The fused-residual ops
# return (y, h) and their backward gives dx to both x and the residual (h = x + residual).

_CAST_NAMES = {v: k for k, v in CASTING_MODES.items()}


def _stats_like(x, n: int) -> tuple:
    import torch

    return tuple(x.new_empty(x.shape[:-1], dtype=torch.float32) for _ in range(n))


def _out_like(x):
    import torch

    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _ln_fake(x, weight, bias, eps, offset):
    return (_out_like(x), *_stats_like(x, 2))


def _ln_res_fake(x, residual, weight, bias, eps, offset):
    return (_out_like(x), _out_like(x), *_stats_like(x, 2))


def _ln_bwd_fake(dy, x, weight, mean, rstd, offset):
    d = x.shape[-1]
    return _out_like(x), x.new_empty((d,) if weight is not None else (0,)), x.new_empty((d,))


def _ln_res_bwd_fake(dy, dh, h, weight, mean, rstd, offset):
    return _ln_bwd_fake(dy, h, weight, mean, rstd, offset)


def _rms_fake(x, weight, eps, offset, casting):
    return (_out_like(x), *_stats_like(x, 1))


def _rms_res_fake(x, residual, weight, eps, offset, casting):
    return (_out_like(x), _out_like(x), *_stats_like(x, 1))


def _rms_bwd_fake(dy, x, weight, rstd, offset, casting):
    return _out_like(x), x.new_empty((x.shape[-1],) if weight is not None else (0,))


def _rms_res_bwd_fake(dy, dh, h, weight, rstd, offset, casting):
    return _rms_bwd_fake(dy, h, weight, rstd, offset, casting)


def _ln_bwd(dy, x, w, mean, rstd, offset, dh=None):
    return layer_norm_backward(dy, x, w, mean, rstd, dresidual=dh, offset=offset)


def _rms_bwd(dy, x, w, rstd, offset, casting, dh=None):
    return rms_norm_backward(dy, x, w, rstd, dresidual=dh, offset=offset, casting_mode=_CAST_NAMES[casting])


TORCH_OPS = (
    TorchOp("layer_norm", "(Tensor x, Tensor? weight, Tensor? bias, float eps, float offset) "
                          "-> (Tensor, Tensor, Tensor)",
            forward=lambda x, w, b, eps, off: layer_norm(x, w, b, eps, return_stats=True, offset=off),
            inference=lambda x, w, b, eps, off: layer_norm(x, w, b, eps, offset=off),
            fake=_ln_fake,
            save=lambda inputs, outputs: ((inputs[0], inputs[1], outputs[1], outputs[2]), inputs[4]),
            backward_schema="(Tensor dy, Tensor x, Tensor? weight, Tensor mean, Tensor rstd, float offset) "
                            "-> (Tensor, Tensor, Tensor)",
            backward=_ln_bwd, backward_fake=_ln_bwd_fake,
            backward_args=lambda saved, state, grads, T: (grads[0], *saved, state), grads_to=(0, 1, 2), native=True),
    TorchOp("rms_norm", "(Tensor x, Tensor? weight, float eps, float offset, int casting) -> (Tensor, Tensor)",
            forward=lambda x, w, eps, off, c: rms_norm(x, w, eps, return_stats=True, offset=off,
                                                       casting_mode=_CAST_NAMES[c]),
            inference=lambda x, w, eps, off, c: rms_norm(x, w, eps, offset=off, casting_mode=_CAST_NAMES[c]),
            fake=_rms_fake,
            save=lambda inputs, outputs: ((inputs[0], inputs[1], outputs[1]), inputs[3:5]),
            backward_schema="(Tensor dy, Tensor x, Tensor? weight, Tensor rstd, float offset, int casting) "
                            "-> (Tensor, Tensor)",
            backward=_rms_bwd, backward_fake=_rms_bwd_fake,
            backward_args=lambda saved, state, grads, T: (grads[0], *saved, *state), grads_to=(0, 1), native=True),
    # h = x + residual and the norm of h in one pass; dx goes to x and to the residual alike
    TorchOp("layer_norm_residual", "(Tensor x, Tensor residual, Tensor? weight, Tensor? bias, float eps, "
                                   "float offset) -> (Tensor, Tensor, Tensor, Tensor)",
            forward=lambda x, r, w, b, eps, off: layer_norm(x, w, b, eps, residual=r, return_stats=True, offset=off),
            inference=lambda x, r, w, b, eps, off: layer_norm(x, w, b, eps, residual=r, offset=off),
            fake=_ln_res_fake, visible=2,
            save=lambda inputs, outputs: ((outputs[1], inputs[2], outputs[2], outputs[3]), inputs[5]),
            backward_schema="(Tensor dy, Tensor? dh, Tensor h, Tensor? weight, Tensor mean, Tensor rstd, "
                            "float offset) -> (Tensor, Tensor, Tensor)",
            backward=lambda dy, dh, h, w, m, r, off: _ln_bwd(dy, h, w, m, r, off, dh),
            backward_fake=_ln_res_bwd_fake,
            backward_args=lambda saved, state, grads, T: (grads[0], grads[1], *saved, state),
            grads_to=((0, 1), 2, 3), native=True),
    TorchOp("rms_norm_residual", "(Tensor x, Tensor residual, Tensor? weight, float eps, float offset, "
                                 "int casting) -> (Tensor, Tensor, Tensor)",
            forward=lambda x, r, w, eps, off, c: rms_norm(x, w, eps, residual=r, return_stats=True, offset=off,
                                                          casting_mode=_CAST_NAMES[c]),
            inference=lambda x, r, w, eps, off, c: rms_norm(x, w, eps, residual=r, offset=off,
                                                            casting_mode=_CAST_NAMES[c]),
            fake=_rms_res_fake, visible=2,
            save=lambda inputs, outputs: ((outputs[1], inputs[2], outputs[2]), inputs[4:6]),
            backward_schema="(Tensor dy, Tensor? dh, Tensor h, Tensor? weight, Tensor rstd, float offset, "
                            "int casting) -> (Tensor, Tensor)",
            backward=lambda dy, dh, h, w, r, off, c: _rms_bwd(dy, h, w, r, off, c, dh),
            backward_fake=_rms_res_bwd_fake,
            backward_args=lambda saved, state, grads, T: (grads[0], grads[1], *saved, *state),
            grads_to=((0, 1), 2), native=True),
)


def _trailing(x, normalized_shape) -> int | None:
    """D = prod(normalized_shape) when it names x's trailing dims, else None."""
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    if not shape or x.dim() < len(shape) or tuple(x.shape[x.dim() - len(shape):]) != shape:
        return None
    return math.prod(shape)


def _norm_args(T, op, x, normalized_shape, params):
    """(reason or None, x with the normalized dims as one last axis, the params as (D,), the
    post-processing view back) for a norm route."""
    d = _trailing(x, normalized_shape)
    reason = T.float_params(x, *params) or (None if d else "normalized_shape does not match the input")
    if reason is None and T.small(op, x.numel()):
        reason = T.SMALL
    if reason:
        return reason, None, (None,) * len(params), None
    if x.shape[-1] == d:   # one normalized dim: read as it is
        return None, x, [p if p is None or p.dim() == 1 else p.reshape(d) for p in params], None
    shape = x.shape
    lead = x.dim() - (1 if isinstance(normalized_shape, int) else len(normalized_shape))
    return None, x.reshape(*shape[:lead], d), [None if p is None else p.reshape(d) for p in params], \
        (lambda y: y.view(shape))


def _route_layer_norm(T, input, normalized_shape, weight=None, bias=None, eps=1e-5):
    """CUDA tensors of float32/float16/bfloat16 (after autocast), weight and bias of the same
    dtype and device, normalized_shape the trailing dims, at least min_size elements."""
    if not input.is_cuda:
        return "not a CUDA tensor"
    dt = T.autocast_dtype("layer_norm", input.dtype)
    reason, x, (w, b), post = _norm_args(T, "layer_norm", T.cast(input, dt), normalized_shape,
                                         (T.cast(weight, dt), T.cast(bias, dt)))
    return reason or ("layer_norm", (x, w, b, float(eps), 0.0), post)


def _route_rms_norm(T, input, normalized_shape, weight=None, eps=None):
    """As layer_norm's; eps=None is PyTorch's default, float32's machine epsilon (the
    arithmetic is float32 for every input dtype)."""
    if not input.is_cuda:
        return "not a CUDA tensor"
    dt = T.autocast_dtype("rms_norm", input.dtype)
    reason, x, (w,), post = _norm_args(T, "rms_norm", T.cast(input, dt), normalized_shape, (T.cast(weight, dt),))
    return reason or ("rms_norm", (x, w, T.FLOAT32_EPS if eps is None else float(eps), 0.0, 0), post)


# ---- the variants and the fused residual under cukern.torch ---------------------------------------

def _torch_norm(rms, x, shape, w, b, eps, offset, cast):
    """The variants in PyTorch's own ops (tensors the kernels do not take, and torch.compile,
    where Inductor fuses them with what is around): the kernels' arithmetic and roundings."""
    import torch

    dims = tuple(range(-len(shape), 0))
    h = x.float()
    if rms:
        r = torch.rsqrt(h.pow(2).mean(dims, keepdim=True) + eps)
        if cast == 2:
            r = r.to(x.dtype).float()
        y = h * r
    else:
        # The mean shifted by the row's first element, as the kernels do: a row of equal elements
        # has mean == that element and variance 0 exactly (a float32 sum / D rounds).
        k = h[(...,) + (slice(0, 1),) * len(dims)]
        d = h - (k + (h - k).mean(dims, keepdim=True))
        y = d * torch.rsqrt(d.pow(2).mean(dims, keepdim=True) + eps)
    if cast:
        y = y.to(x.dtype).float()
    if w is not None:
        y = y * (w.float() + offset)
    if b is not None:
        y = y + b.float()
    return y.to(x.dtype)


def _norm_call(T, ops, rms, x, residual, shape, w, b, eps, offset, cast):
    """y, or (y, h) with a residual (h = x + residual), on the kernels where they take the call
    (``T``: cukern.torch._tools, ``ops``: the TorchOps by name)."""
    op = "rms_norm" if rms else "layer_norm"
    if eps is None:
        eps = T.FLOAT32_EPS
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if x.is_cuda:
        dt = T.autocast_dtype(op, x.dtype)
        x, residual, w, b = (T.cast(t, dt) for t in (x, residual, w, b))
    reason = "compiling" if T.compiling() else None
    if reason is None and residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                                    or residual.device != x.device):
        reason = "residual differs from x in shape, dtype or device"
    if reason is None:
        reason, xk, params, post = _norm_args(T, op, x, shape, (w,) if rms else (w, b))
    if reason is not None:
        if residual is None:
            return _torch_norm(rms, x, shape, w, b, float(eps), offset, cast)
        h = x + residual
        return _torch_norm(rms, h, shape, w, b, float(eps), offset, cast), h
    tail = (float(eps), float(offset)) + ((int(cast),) if rms else ())
    if residual is None:
        out = ops[op](xk, *params, *tail)
        return out if post is None else post(out)
    rk = residual if post is None else residual.reshape(xk.shape)
    y, h = ops[op + "_residual"](xk, rk, *params, *tail)
    return (y, h) if post is None else (post(y), post(h))


def _options(m, rms: bool) -> tuple:
    """(offset, cast) of a module, checked."""
    off = _offset(m.offset, m.weight)
    return off, (_casting(m.casting_mode, True) if rms else 0)


def _init_variant(m) -> None:
    """A module with an offset starts with the weight it applies at 1: its weight at 1 - offset
    (Gemma's zeros for offset 1, as TransformerEngine's zero-centred gamma)."""
    import torch

    _options(m, hasattr(m, "casting_mode"))
    if m.weight is not None and m.offset:
        with torch.no_grad():
            m.weight.fill_(1.0 - float(m.offset))


def _module_forward(rms: bool):
    def forward(T, ops, m, x, residual=None):
        off, cast = _options(m, rms)
        return _norm_call(T, ops, rms, x, residual, m.normalized_shape, m.weight, None if rms else m.bias, m.eps, off,
                          cast)
    return forward


def _torch_api(T, ops, modules) -> dict:
    """``FusedAddRMSNorm`` / ``FusedAddLayerNorm`` (subclasses of the drop-in modules) and
    ``fused_add_rms_norm`` / ``fused_add_layer_norm``."""
    def fused_add_rms_norm(x, residual, weight=None, eps=None, *, offset=0.0, casting_mode="gemma"):
        """``h = x + residual`` (rounded to the dtype) and ``rms_norm(h)`` in one pass: ``(y, h)``,
        with autograd (dx reaches x and residual alike) and torch.compile. x, residual (*, D);
        weight (D,) or None; offset and casting_mode as ``cukern.rms_norm``."""
        off = _offset(offset, weight)
        return _norm_call(T, ops, True, x, residual, x.shape[-1:], weight, None, eps, off, _casting(casting_mode, True))

    def fused_add_layer_norm(x, residual, weight=None, bias=None, eps=1e-5, *, offset=0.0):
        """``h = x + residual`` and ``layer_norm(h)`` in one pass: ``(y, h)``; see
        ``fused_add_rms_norm``."""
        off = _offset(offset, weight)
        return _norm_call(T, ops, False, x, residual, x.shape[-1:], weight, bias, eps, off, 0)

    def fused(name: str, rms: bool) -> type:
        base = modules[name]
        fwd = _module_forward(rms)

        def forward(self, x, residual):
            return fwd(T, ops, self, x, residual)

        doc = (f"``cukern.torch.{name}`` whose ``forward(x, residual)`` returns ``(y, h)``: ``h = x + residual`` "
               f"(the residual stream, rounded to the dtype) and y its norm, in one pass, with autograd (dx "
               f"reaches x and residual alike). Same constructor (offset{', casting_mode' if rms else ''} "
               f"included), parameters and state_dict as ``torch.nn.{name}``.")
        return type(f"FusedAdd{name}", (base,), {"forward": forward, "__doc__": doc, "__module__": "cukern.torch"})

    return {"fused_add_rms_norm": fused_add_rms_norm, "fused_add_layer_norm": fused_add_layer_norm,
            "FusedAddRMSNorm": fused("RMSNorm", True), "FusedAddLayerNorm": fused("LayerNorm", False)}
