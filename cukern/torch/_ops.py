"""Each family's TorchOps made into what PyTorch runs, both from the one declaration:

* the custom ops ``torch.ops.cukern.<name>`` and ``<name>_backward`` (schema, fake for
  torch.compile, autograd formula): what compiled graphs call, since dynamo cannot trace into
  the kernel launches;
* the eager ``torch.autograd.Function``, straight to the array functions: outside
  torch.compile the custom-op dispatch (schema checks, fake-tensor bookkeeping, the autograd
  wrapper) would cost tens of microseconds a call.

Both save the same tensors and call the same backward; a test checks they give the same bits.
Custom ops cannot return None: an absent gradient travels as a 0-element tensor, and the
autograd formula hands back None for inputs that were None.
"""
from __future__ import annotations

import os

import torch
from torch import Tensor

from .. import _kernels, _plans
from .._family import TorchOp
from .._registry import families
from . import _native, _tools

_LIB = "cukern"


def _arity(schema: str) -> int:
    """The number of inputs of a schema ``(a, b, ...) -> ...``."""
    inside = schema[schema.index("(") + 1:schema.index(") ->")]
    return len([p for p in inside.split(",") if p.strip()])


def _single(schema: str) -> bool:
    return schema.rstrip().endswith("-> Tensor")


class Op:
    """One op, built: ``op(*args)`` runs the eager path (an autograd Function when an input
    needs a gradient, the plain forward otherwise) and returns the visible output(s);
    ``op.compiled(*args)`` calls the custom op (inside torch.compile)."""

    def __init__(self, spec: TorchOp, index: int):
        self.spec = spec
        self.index = index   # (the native path's op number)
        self.visible = spec.visible
        self.inputs = _arity(spec.schema)
        self.function = _function(spec, self.inputs)
        self.custom, self.custom_backward = _custom(spec, self.inputs)
        self._inference = spec.inference or (lambda *a: spec.forward(*a)[:spec.visible])

    def __call__(self, *args):
        if self.spec.native and _native.enabled() and args[0].is_cuda:
            ext = _native.module()
            if ext is not None:
                out = ext.call(self.index, args)
                if out is None:   # a signature not seen yet: the Python path, recorded
                    return self._record(ext, args)
                if out is not False:   # (False: declined, the Python path)
                    return out
        return self._python(args)

    def _python(self, args):
        if torch.is_grad_enabled():
            for a in args:
                if isinstance(a, Tensor) and a.requires_grad:
                    return self.function.apply(*args)
        return self._inference(*args)

    def _record(self, ext, args):
        grad = torch.is_grad_enabled() and any(isinstance(a, Tensor) and a.requires_grad for a in args)
        key = ext.key(self.index, args, grad)
        if key is None:
            return self._python(args)
        if grad:   # the Function's forward records, its backward registers (_function)
            _native.begin(key)
            try:
                return self.function.apply(*args)
            finally:
                _native.take()
        with _plans.record() as plans:
            out = self._inference(*args)
        _native.register_inference(ext, key, args, out if isinstance(out, tuple) else (out,), plans)
        return out

    def compiled(self, *args):
        out = self.custom(*args)
        if isinstance(out, Tensor):
            return out
        return out[0] if self.visible == 1 else tuple(out[:self.visible])


def _scatter(spec: TorchOp, n: int, grads, needed, present=None) -> tuple:
    """The backward's gradients placed at the inputs they belong to (None elsewhere)."""
    out = [None] * n
    for g, to in zip(grads, spec.grads_to):
        for i in (to if isinstance(to, tuple) else (to,)):
            if needed[i] and (present is None or present[i]):
                out[i] = g
    return tuple(out)


# The backward's plan is built ahead (its kernels compiled on a background thread while the
# forward goes on) for the first few forward calls of each op in a process: a first training
# step otherwise compiles every backward kernel after the forward, one after another.
# CUKERN_BUILD_AHEAD: how many (0: never).
_AHEAD_CALLS = int(os.environ.get("CUKERN_BUILD_AHEAD", "4") or 0)
_ahead: dict[str, int] = {}


def _build_backward_ahead(spec: TorchOp, tensors, state, outputs) -> None:
    # (the forward's visible outputs stand in for the gradients: the same shapes, dtypes and
    # layouts as the gradients of a usual loss)
    args = spec.backward_args(tensors, state, tuple(outputs[:spec.visible]), _tools)
    device = next((t.device for t in tensors if isinstance(t, Tensor) and t.is_cuda), None)
    if device is not None:   # (a new thread's current device is the first)
        with torch.cuda.device(device):
            _plans.build_ahead(spec.backward, *args)


def _function(spec: TorchOp, n: int):
    class Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            key = _native.take()
            if key is None:
                outputs = spec.forward(*inputs)
            else:
                with _plans.record() as plans:
                    outputs = spec.forward(*inputs)
            tensors, state = spec.save(inputs, outputs)
            ctx.save_for_backward(*tensors)
            ctx.state = state
            ctx.recording = None
            calls = _ahead.get(spec.name, 0)
            if calls < _AHEAD_CALLS:
                _ahead[spec.name] = calls + 1
                _kernels.in_background(_build_backward_ahead, spec, tensors, state, outputs)
            if key is not None:   # the signature's first call: keep what the native path needs
                ext = _native.module()
                fwd = _native.forward_parts(ext, inputs, outputs, tensors, plans)
                if fwd is None:
                    ext.decline(key)
                else:
                    ctx.recording = (key, fwd)
            return outputs[0] if spec.visible == 1 else tuple(outputs[:spec.visible])

        @staticmethod
        def backward(ctx, *grads):
            saved = ctx.saved_tensors
            args = spec.backward_args(saved, ctx.state, grads, _tools)
            # (the saved buffers are written over only where the graph goes with this pass)
            donate = spec.donating_backward is not None and _tools.saved_used_once()
            backward = spec.donating_backward if donate else spec.backward
            if ctx.recording is None:
                out = backward(*args)
            else:
                (key, fwd), ctx.recording = ctx.recording, None
                with _plans.record() as plans:
                    out = backward(*args)
                # (the native node replays the donating form, on copies where the graph is kept)
                if donate or spec.donating_backward is None:
                    _native.register_training(_native.module(), key, fwd, spec.visible, args, grads, saved, out,
                                              spec.grads_to, plans)
                else:
                    _native.retry(_native.module(), key)
            return _scatter(spec, n, out, ctx.needs_input_grad)

    Function.__name__ = Function.__qualname__ = f"cukern_{spec.name}"
    return Function


def _as_tensors(values, like: Tensor) -> tuple:
    return tuple(like.new_empty((0,)) if v is None else v for v in values)


def _custom(spec: TorchOp, n: int):
    single, single_bwd = _single(spec.schema), _single(spec.backward_schema)

    def forward(*args):
        out = spec.forward(*args)
        return out[0] if single else tuple(out)

    def fake(*args):
        out = spec.fake(*args)
        return out[0] if single else tuple(out)

    def backward_impl(*args):
        like = next(a for a in args if isinstance(a, Tensor))
        out = _as_tensors(spec.backward(*args), like)
        return out[0] if single_bwd else out

    def backward_fake(*args):
        out = spec.backward_fake(*args)
        return out[0] if single_bwd else tuple(out)

    op = torch.library.custom_op(f"{_LIB}::{spec.name}", forward, mutates_args=(), schema=spec.schema)
    op.register_fake(fake)
    bwd = torch.library.custom_op(f"{_LIB}::{spec.name}_backward", backward_impl, mutates_args=(),
                                  schema=spec.backward_schema)
    bwd.register_fake(backward_fake)

    def setup_context(ctx, inputs, output):
        outputs = (output,) if isinstance(output, Tensor) else tuple(output)
        tensors, state = spec.save(inputs, outputs)
        ctx.save_for_backward(*tensors)
        ctx.state = state
        ctx.present = tuple(a is not None for a in inputs)
        if len(outputs) > spec.visible:
            ctx.mark_non_differentiable(*outputs[spec.visible:])

    def autograd(ctx, *grads):
        out = bwd(*spec.backward_args(ctx.saved_tensors, ctx.state, grads[:spec.visible], _tools))
        out = (out,) if isinstance(out, Tensor) else tuple(out)
        return _scatter(spec, n, out, ctx.needs_input_grad, ctx.present)

    op.register_autograd(autograd, setup_context=setup_context)
    return op, bwd


OPS: dict[str, Op] = {spec.name: Op(spec, i) for i, spec in
                      enumerate(spec for family in families() for spec in family.torch_ops)}
