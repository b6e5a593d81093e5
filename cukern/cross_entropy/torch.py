"""Cross-entropy under ``cukern.torch``: custom ops, the drop-in's route and
``linear_cross_entropy``."""
from __future__ import annotations

from .._family import TorchOp
from .checks import _options
from .configs import REDUCTIONS
from .linear import _linear_forward_backward, linear_cross_entropy
from .loss import _backward, cross_entropy, cross_entropy_forward_backward
from .upstream import _scale_gradient

# ---- PyTorch bindings -------------------------------------------------------------------------

def _fake(logits, target, ignore_index, smoothing, z_loss, softcap, reduction, float32_loss):
    import torch

    dtype = torch.float32 if float32_loss else logits.dtype
    loss = logits.new_empty(target.shape if reduction == "none" else (), dtype=dtype)
    return (loss, torch.empty_like(logits, memory_format=torch.contiguous_format),
            logits.new_empty(target.shape, dtype=torch.float32))


def _kwargs(ignore_index, smoothing, z_loss, softcap, reduction, float32_loss) -> dict:
    return dict(ignore_index=ignore_index, label_smoothing=smoothing, z_loss=z_loss,
                softcap=softcap if softcap > 0 else None, reduction=reduction,
                loss_dtype="float32" if float32_loss else None)


def _ce_backward(dloss, unit, logits, target, lse, ignore_index, smoothing, z_loss, softcap, reduction,
                 donate: bool):
    opts = _options(ignore_index, smoothing, z_loss, softcap, reduction)
    return (_backward(dloss, logits, target, lse, unit, opts, donate),)


TORCH_OPS = (
    # The forward is the training form: the loss and, for an upstream gradient of 1, its
    # gradient, kept with the logits and lse for the backward. There, rows whose upstream
    # gradient is exactly 1 take the kept gradient (eager, with the graph not retained: as it
    # is, no work at all); others are computed again from the logits, so that the upstream
    # gradient is applied before the one rounding, as PyTorch's own loss does.
    TorchOp("cross_entropy",
            "(Tensor logits, Tensor target, int ignore_index, float label_smoothing, float z_loss, "
            "float softcap, str reduction, bool float32_loss) -> (Tensor, Tensor, Tensor)",
            forward=lambda x, t, *o: cross_entropy_forward_backward(x, t, return_lse=True, **_kwargs(*o)),
            inference=lambda x, t, *o: cross_entropy(x, t, **_kwargs(*o)),
            fake=_fake,
            save=lambda inputs, outputs: ((outputs[1], inputs[0], inputs[1], outputs[2]), tuple(inputs[2:7])),
            backward_schema="(Tensor dloss, Tensor unit, Tensor logits, Tensor target, Tensor lse, int ignore_index, "
                            "float label_smoothing, float z_loss, float softcap, str reduction) -> Tensor",
            backward=lambda *a: _ce_backward(*a, donate=False),
            donating_backward=lambda *a: _ce_backward(*a, donate=True),
            backward_fake=lambda dloss, unit, *a: (unit.new_empty(unit.shape),),
            backward_args=lambda saved, state, grads, T: (grads[0], *saved, *state),
            grads_to=(0,), native=True),
)


def _lce_forward(h, w, t, b, opts):
    kw = _kwargs(*opts)
    loss_dtype = kw.pop("loss_dtype")
    opts = _options(kw["ignore_index"], kw["label_smoothing"], kw["z_loss"], kw["softcap"], kw["reduction"])
    loss, dh, dw, db = _linear_forward_backward(h, w, t, b, opts, loss_dtype, unrounded=True)
    return loss, dh, dw, (h.new_empty((0,), dtype=dw.dtype) if db is None else db)


def _lce_fake(h, w, t, b, ignore_index, smoothing, z_loss, softcap, reduction, float32_loss):
    import torch

    f32 = torch.float32
    loss = h.new_empty((), dtype=f32 if float32_loss else h.dtype)
    return (loss, h.new_empty(h.shape, dtype=f32), w.new_empty(w.shape, dtype=f32),
            h.new_empty((w.shape[0],) if b is not None else (0,), dtype=f32))


def _lce_scale(dloss, dh, dw, db, dtype, donate: bool):
    """The gradients kept in float32 for an upstream gradient of 1 times the real one, each
    rounded once to the inputs' ``dtype`` (a torch dtype)."""
    dt = str(dtype).removeprefix("torch.")
    out = tuple(_scale_gradient(dloss, g, dt, donate) for g in (dh, dw))
    return out + ((_scale_gradient(dloss, db, dt, donate) if db.numel() else None),)


TORCH_OPS += (
    # Like the cross-entropy's: the forward computes the loss and every gradient for an upstream
    # gradient of 1 (the logits never exist whole), kept unrounded in float32; the backward
    # applies the real one and rounds each once.
    TorchOp("linear_cross_entropy",
            "(Tensor hidden, Tensor weight, Tensor target, Tensor? bias, int ignore_index, float label_smoothing, "
            "float z_loss, float softcap, str reduction, bool float32_loss) -> (Tensor, Tensor, Tensor, Tensor)",
            forward=lambda h, w, t, b, *o: _lce_forward(h, w, t, b, o),
            inference=lambda h, w, t, b, *o: linear_cross_entropy(h, w, t, b, **_kwargs(*o)),
            fake=_lce_fake,
            save=lambda inputs, outputs: (tuple(outputs[1:4]), inputs[0].dtype),
            backward_schema="(Tensor dloss, Tensor dhidden, Tensor dweight, Tensor dbias, ScalarType dtype) "
                            "-> (Tensor, Tensor, Tensor)",
            backward=lambda dl, dh, dw, db, dt: _lce_scale(dl, dh, dw, db, dt, donate=False),
            donating_backward=lambda dl, dh, dw, db, dt: _lce_scale(dl, dh, dw, db, dt, donate=True),
            backward_fake=lambda dl, dh, dw, db, dt: tuple(g.new_empty(g.shape, dtype=dt) for g in (dh, dw, db)),
            backward_args=lambda saved, state, grads, T: (grads[0], *saved, state),
            grads_to=(0, 1, 3)),
)


def _torch_fallback(hidden, weight, target, bias, ignore_index, label_smoothing, z_loss, softcap, reduction):
    """PyTorch's own ops for what the kernels do not take (CPU tensors): the same loss."""
    import torch
    import torch.nn.functional as F

    z = F.linear(hidden, weight, bias).float()
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    z, t = z.reshape(-1, z.shape[-1]), target.reshape(-1)
    loss = F.cross_entropy(z, t, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction=reduction)
    if z_loss:
        keep = (t != ignore_index).float()
        zl = z_loss * torch.logsumexp(z, dim=-1) ** 2 * keep
        loss = loss + {"none": zl, "sum": zl.sum(), "mean": zl.sum() / keep.sum()}[reduction]
    return loss.reshape(target.shape) if reduction == "none" else loss


def _torch_api(T, ops, modules) -> dict:
    """``cukern.torch.linear_cross_entropy`` and ``cukern.torch.LinearCrossEntropyLoss``."""
    import torch
    from torch import nn

    op = ops["linear_cross_entropy"]

    def linear_cross_entropy(hidden, weight, target, bias=None, *, ignore_index=-100, label_smoothing=0.0,
                             z_loss=0.0, softcap=None, reduction="mean"):
        """``F.cross_entropy(F.linear(hidden, weight, bias), target)`` for an LM head, without the
        (tokens, vocabulary) logits: autograd (dhidden, dweight, dbias) and torch.compile.

        hidden (*, H), weight (V, H), bias (V,) or None; target (*) int64/int32. Under CUDA
        autocast the matrix products run in the autocast dtype and the loss is float32, as
        F.linear followed by F.cross_entropy give. reduction "mean" or "sum" with autograd, also
        "none" without. z_loss and softcap as cukern.cross_entropy. Tensors that are not on a
        GPU run PyTorch's ops."""
        if not (hidden.is_cuda and weight.is_cuda and target.is_cuda):
            return _torch_fallback(hidden, weight, target, bias, ignore_index, label_smoothing, z_loss, softcap,
                                   reduction)
        f32 = False
        if torch.is_autocast_enabled("cuda"):
            dt = torch.get_autocast_dtype("cuda")
            hidden, weight, bias = T.cast(hidden, dt), T.cast(weight, dt), T.cast(bias, dt)
            f32 = True
        args = (hidden, weight, target, bias, int(ignore_index), float(label_smoothing), float(z_loss),
                float(softcap or 0.0), reduction, f32)
        return op.compiled(*args) if T.compiling() else op(*args)

    class LinearCrossEntropyLoss(nn.Module):
        """The loss of an LM head: ``forward(hidden, weight, target, bias=None)`` is
        ``linear_cross_entropy`` with the options given here (Liger's fused linear cross-entropy
        loss takes the same inputs)."""

        def __init__(self, ignore_index=-100, label_smoothing=0.0, z_loss=0.0, softcap=None, reduction="mean"):
            super().__init__()
            self.ignore_index, self.label_smoothing, self.z_loss = ignore_index, label_smoothing, z_loss
            self.softcap, self.reduction = softcap, reduction

        def forward(self, hidden, weight, target, bias=None):
            return linear_cross_entropy(hidden, weight, target, bias, ignore_index=self.ignore_index,
                                        label_smoothing=self.label_smoothing, z_loss=self.z_loss,
                                        softcap=self.softcap, reduction=self.reduction)

    LinearCrossEntropyLoss.__module__ = "cukern.torch"
    return {"linear_cross_entropy": linear_cross_entropy, "LinearCrossEntropyLoss": LinearCrossEntropyLoss}


def _route(T, input, target, weight=None, size_average=None, ignore_index=-100, reduce=None, reduction="mean",
           label_smoothing=0.0):
    """(N, C) logits of a float dtype with (N,) integer class targets; no class weights, no
    probability targets, no legacy size_average/reduce. Under autocast, which computes the
    loss of half-precision logits in float32, the kernels read the half logits as they are
    (they compute in float32) and return a float32 loss: no float32 copy of the logits."""
    x = input
    if not (x.is_cuda and target.is_cuda and x.device == target.device):
        return "not CUDA tensors on one device"
    if weight is not None or size_average is not None or reduce is not None:
        return "class weights or legacy reduction arguments"
    if x.dim() != 2 or target.dim() != 1 or target.shape[0] != x.shape[0]:
        return "not (N, C) logits with (N,) class targets"
    if target.dtype not in T.INDEX_DTYPES:
        return "probability targets or target dtype"
    if x.dtype not in T.FLOAT_DTYPES:
        return f"dtype {x.dtype}"
    if reduction not in REDUCTIONS or not 0.0 <= label_smoothing <= 1.0 or x.shape[1] == 0:
        return "reduction, label_smoothing or classes"
    if T.small("cross_entropy", x.numel()):
        return T.SMALL
    dt = T.autocast_dtype("cross_entropy", x.dtype)
    float32_loss = dt == T.torch.float32 and x.dtype != dt
    if dt != x.dtype and not float32_loss:
        x = T.cast(x, dt)
    return "cross_entropy", (x, target, int(ignore_index), float(label_smoothing), 0.0, 0.0, reduction,
                             float32_loss), None


def _probe(f, x):
    import torch

    return f(x.reshape(-1, 8), torch.zeros((x.numel() // 8,), dtype=torch.long, device=x.device))
