"""The norms' benchmark cases: the array API and the PyTorch path."""
from __future__ import annotations

import functools

from .._bench_cases import Case, TorchCase, elements_bytes, generator, randn
from .backward import layer_norm_backward, rms_norm_backward
from .forward import layer_norm, rms_norm

# ---- benchmark cases ----------------------------------------------------------------------------

# The workload: rows of the model dim 4096 for a batch of 32 x 2048 tokens.
WORKLOAD = {"full": (65536, 4096), "quick": (8192, 4096), "dtype": "bfloat16"}


def _inputs(shape, dtype, seed, *, bias, grad=False, residual=False) -> dict:
    gen = generator(seed)
    d = shape[-1]
    t = {"x": randn(shape, dtype, gen), "w": randn((d,), dtype, gen),
         "b": randn((d,), dtype, gen) if bias else None}
    if residual:
        t["r"] = randn(shape, dtype, gen)
    if grad:
        t["dy"] = randn(shape, dtype, gen)
        t["leaves"] = tuple(a.detach().requires_grad_(True) for a in (t["x"], t["w"]) + ((t["b"],) if bias else ()))
    return t


def _fwd(rms, t):
    return rms_norm(t["x"], t["w"]) if rms else layer_norm(t["x"], t["w"], t["b"])


def _torch_fwd(rms, t):
    import torch.nn.functional as F

    x = t["x"]
    return F.rms_norm(x, x.shape[-1:], t["w"], eps=1e-6) if rms else F.layer_norm(x, x.shape[-1:], t["w"], t["b"])


def _fwd_bwd(rms, t):
    if rms:
        y, rstd = rms_norm(t["x"], t["w"], return_stats=True)
        return (y, *rms_norm_backward(t["dy"], t["x"], t["w"], rstd))
    y, mean, rstd = layer_norm(t["x"], t["w"], t["b"], return_stats=True)
    return (y, *layer_norm_backward(t["dy"], t["x"], t["w"], mean, rstd))


def _torch_fwd_bwd(rms, t):
    import torch

    y = _forward_on(None, t, rms)
    return (y.detach(), *torch.autograd.grad(y, t["leaves"], t["dy"]))


def _forward_on(F, t, rms):
    """The forward through ``F`` (torch.nn.functional, cukern.torch or None for PyTorch's) on
    the autograd leaves: what the PyTorch-path cases time."""
    if F is None:
        import torch.nn.functional as F
    x, w = t["leaves"][:2]
    if rms:
        return F.rms_norm(x, x.shape[-1:], w, eps=1e-6)
    return F.layer_norm(x, x.shape[-1:], w, t["leaves"][2])


def _res(rms, t):
    return rms_norm(t["x"], t["w"], residual=t["r"]) if rms else layer_norm(t["x"], t["w"], t["b"], residual=t["r"])


def _torch_res(rms, t):
    import torch.nn.functional as F

    h = t["x"] + t["r"]
    y = F.rms_norm(h, h.shape[-1:], t["w"], eps=1e-6) if rms else F.layer_norm(h, h.shape[-1:], t["w"], t["b"])
    return y, h


def _fp8_inputs(shape, dtype, seed, *, bias) -> dict:
    import torch

    t = _inputs(shape, dtype, seed, bias=bias)
    t["scale"] = torch.full((1,), 64.0, device="cuda")
    t["amax"] = torch.zeros(1, device="cuda")
    return t


def _fp8(rms, t):
    out = dict(out_dtype="float8_e4m3fn", scale=t["scale"], amax=t["amax"])
    y = rms_norm(t["x"], t["w"], **out) if rms else layer_norm(t["x"], t["w"], t["b"], **out)
    return y, t["amax"]


def _torch_fp8(rms, t):
    """PyTorch's norm, its amax, and the scaled, saturated cast (TransformerEngine's contract)."""
    import torch

    y = _torch_fwd(rms, t)
    y8 = (y.float() * t["scale"]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return y8, y.abs().amax().float().reshape(1)


def bench_cases(quick: bool) -> list:
    """(N, D); bytes in passes of N*D elements: fwd 2 (x, y), fwd+bwd 5 (+ dy, x, dx), fused
    residual 4 (x, r in; y, h out). Weights and statistics are O(N + D), left out."""
    nd, dt = WORKLOAD["quick" if quick else "full"], WORKLOAD["dtype"]
    p = functools.partial
    cases = []
    for rms, name in ((False, "layer_norm"), (True, "rms_norm")):
        make = p(_inputs, nd, dt, bias=not rms)
        cases += [
            Case(f"{name} fwd", "norm", nd, dt, elements_bytes(nd, dt, 2), make, p(_fwd, rms),
                        p(_torch_fwd, rms)),
            Case(f"{name} fwd+bwd", "norm", nd, dt, elements_bytes(nd, dt, 5), p(make, grad=True),
                        p(_fwd_bwd, rms), p(_torch_fwd_bwd, rms)),
        ]
    for rms, name in ((False, "layer_norm"), (True, "rms_norm")):
        cases.append(Case(f"{name} +residual fwd", "norm", nd, dt, elements_bytes(nd, dt, 4),
                                 p(_inputs, nd, dt, bias=not rms, residual=True), p(_res, rms), p(_torch_res, rms)))
    # fp8 output (e4m3 with its amax): read 2 bytes an element, write 1
    for rms, name in ((False, "layer_norm"), (True, "rms_norm")):
        cases.append(Case(f"{name} fwd fp8", "norm", nd, dt, elements_bytes(nd, dt, 1.5),
                                 p(_fp8_inputs, nd, dt, bias=not rms), p(_fp8, rms), p(_torch_fp8, rms)))
    # (the order of the table as before: fwd, fwd, fwd+bwd, fwd+bwd, residual, residual)
    return [cases[0], cases[2], cases[1], cases[3], cases[4], cases[5], cases[6], cases[7]]


def _liger(rms, t):
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    x, w = t["leaves"][:2]
    if rms:
        return LigerRMSNormFunction.apply(x, w, 1e-6, 0.0, "llama", False)
    return LigerLayerNormFunction.apply(x, w, t["leaves"][2], 1e-5)


@functools.cache
def _quack_layer_norm():
    """quack's LayerNorm kernels (``layernorm_fwd`` / ``layernorm_bwd``, float32 weights) under
    an autograd Function: quack gives RMSNorm one, LayerNorm only its two kernels."""
    import torch
    from quack.rmsnorm import layernorm_bwd, layernorm_fwd

    class QuackLayerNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w, b):
            y, rstd, mean = layernorm_fwd(x, w.float(), b.float(), eps=1e-5, return_rstd=True, return_mean=True)
            ctx.save_for_backward(x, w, rstd, mean)
            return y

        @staticmethod
        def backward(ctx, dy):
            x, w, rstd, mean = ctx.saved_tensors
            dx, dw, db = layernorm_bwd(x, w.float(), dy.contiguous(), rstd, mean, has_bias=True)
            return dx, dw.to(w.dtype), db.to(w.dtype)

    return QuackLayerNorm


def _quack(rms, t):
    x, w = t["leaves"][:2]
    if rms:
        from quack import rmsnorm

        return rmsnorm(x, w, eps=1e-6)
    return _quack_layer_norm().apply(x, w, t["leaves"][2])


def torch_bench_cases(quick: bool) -> list:
    """The norms through cukern.torch with autograd, against PyTorch eager, torch.compile,
    Liger and quack: forward + backward, and the forward alone without autograd."""
    nd, dt = WORKLOAD["quick" if quick else "full"], WORKLOAD["dtype"]
    p = functools.partial
    cases = []
    for rms, name in ((False, "layer_norm"), (True, "rms_norm")):
        make = p(_inputs, nd, dt, bias=not rms, grad=True)
        cases.append(TorchCase(f"{name} fwd+bwd", "norm", nd, dt, elements_bytes(nd, dt, 5), make,
                                      p(_forward_on, rms=rms), p(_fwd_bwd, rms), liger=p(_liger, rms),
                                      quack=p(_quack, rms)))
    cases.append(TorchCase("rms_norm fwd", "norm", nd, dt, elements_bytes(nd, dt, 2),
                                  p(_inputs, nd, dt, bias=False, grad=True), p(_forward_on, rms=True),
                                  p(_fwd, True), liger=p(_liger, True), quack=p(_quack, True), backward=False))
    return cases
