"""What a model's module computes, found by running it: ``patch(model)`` routes a module to a
cukern op only where the module's own forward and backward, on a small random input, agree with
what that op computes (one of its variants) to the dtype's rounding. A class name never decides.

Norms: a leaf module with a 1-D ``weight`` (and perhaps a 1-D ``bias``) whose forward maps one
(..., D) tensor to its shape, against RMSNorm with the weight or ``1 + weight`` (Gemma) in each
of cukern's casting modes (LLaMA's rounding of the normalized input before the weight, or float32
throughout), and LayerNorm with or without its bias. The verdict is kept per (class, dtype,
width, parameters, eps): modules of one class and configuration are run once.
"""
from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from ..norm.configs import CASTING_MODES


@dataclasses.dataclass(frozen=True)
class NormVariant:
    """A cukern norm: ``kind`` "rms" or "layer"; ``offset`` added to the weight (Gemma's 1);
    ``casting`` the RMSNorm casting mode's int (``CASTING_MODES``); ``bias`` whether LayerNorm
    adds the module's bias; ``eps`` the module's."""
    kind: str
    offset: float
    casting: int
    bias: bool
    eps: float


_EPS_NAMES = ("variance_epsilon", "eps", "epsilon", "rms_norm_eps", "layer_norm_eps")
_cache: dict[tuple, tuple[NormVariant | None, str | None]] = {}


def _eps_of(m: nn.Module) -> float | None:
    for name in _EPS_NAMES:
        v = getattr(m, name, None)
        if isinstance(v, (float, int)) and not isinstance(v, bool) and 0 < v < 1:
            return float(v)
    return None


def candidate(v: NormVariant, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """What cukern's op computes for variant ``v``, in PyTorch's ops (cukern/norm's documented
    arithmetic): float32 statistics; "gemma" rounds once at the end, "llama" rounds the
    normalized input to its dtype before the weight, "none" is PyTorch's rms_norm in the input's
    dtype."""
    xf = x.float()
    wf = w.float() + v.offset
    if v.kind == "layer":
        mean = xf.mean(-1, keepdim=True)
        y = (xf - mean) * torch.rsqrt((xf - mean).pow(2).mean(-1, keepdim=True) + v.eps) * wf
        return (y + b.float() if v.bias and b is not None else y).to(x.dtype)
    if v.casting == CASTING_MODES["none"] and x.dtype != torch.float32:   # (PyTorch's rms_norm in x's dtype)
        return torch.nn.functional.rms_norm(x, x.shape[-1:], w + v.offset if v.offset else w, v.eps)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + v.eps)
    if v.casting == CASTING_MODES["llama"]:
        return y.to(x.dtype) * (w + v.offset if v.offset else w)
    return (y * wf).to(x.dtype)


def _variants(eps: float, has_bias: bool) -> list[NormVariant]:
    out = [NormVariant("rms", off, CASTING_MODES[c], False, eps) for off in (0.0, 1.0)
           for c in ("gemma", "llama", "none")]
    out += [NormVariant("layer", off, 0, bias, eps) for off in (0.0, 1.0) for bias in ((True, False) if has_bias
                                                                                        else (False,))]
    return out


def _ulps(dtype: torch.dtype) -> float:
    return {torch.float32: 2.0**-20, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}.get(dtype, 2.0**-20)


def _disagreement(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference relative to the reference's largest magnitude (inf for a NaN or a
    shape that differs)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return math.inf
    d = (got.float() - want.float()).abs().max().item()
    return d / max(want.float().abs().max().item(), 1e-30) if math.isfinite(d) else math.inf


def recognize_norm(m: nn.Module) -> tuple[NormVariant | None, str | None]:
    """(the cukern norm ``m`` computes, None) or (None, why not): run on a small random input of
    its weight's dtype and device, forward and backward, against every variant."""
    w = getattr(m, "weight", None)
    b = getattr(m, "bias", None)
    if not isinstance(w, nn.Parameter) or w.dim() != 1 or any(True for _ in m.children()):
        return None, "not a leaf module with a 1-D weight"
    if b is not None and (not isinstance(b, torch.Tensor) or b.shape != w.shape):
        return None, "a bias that is not 1-D like the weight"
    if not w.dtype.is_floating_point:
        return None, f"weight dtype {w.dtype}"
    eps = _eps_of(m)
    if eps is None:
        return None, "no eps attribute"
    key = (type(m), w.dtype, w.shape[0], b is not None, eps)
    if key not in _cache:
        _cache[key] = _probe(m, eps)
    return _cache[key]


def _probe(m: nn.Module, eps: float) -> tuple[NormVariant | None, str | None]:
    w, b = m.weight, getattr(m, "bias", None)
    g = torch.Generator(device="cpu").manual_seed(0)
    d = w.shape[0]
    x = (torch.randn(2, 3, d, generator=g) * 3 + 0.5).to(device=w.device, dtype=w.dtype)
    # (the module's own parameters may hold ones and zeros: probe with random ones of their
    # shape, so that LayerNorm's bias and Gemma's 1 + w are told apart)
    pw = (torch.rand(d, generator=g) + 0.5).to(device=w.device, dtype=w.dtype)
    pb = None if b is None else torch.randn(d, generator=g).to(device=w.device, dtype=w.dtype)
    dy = torch.randn(2, 3, d, generator=g).to(device=w.device, dtype=w.dtype)
    saved = (w.data, None if b is None else b.data)
    try:
        with torch.enable_grad():
            w.data = pw
            if b is not None:
                b.data = pb
            xl = x.clone().requires_grad_(True)
            try:
                own = m(xl)
            except Exception as e:  # noqa: BLE001 - any module: one that cannot run so is not a norm
                return None, f"its forward does not take one (..., {d}) tensor ({type(e).__name__})"
            if not isinstance(own, torch.Tensor) or own.shape != x.shape:
                return None, "its forward does not map (..., D) to (..., D)"
            own_grads = torch.autograd.grad(own, (xl, w) + ((b,) if b is not None else ()), dy, allow_unused=True)
    finally:
        w.data = saved[0]
        if b is not None:
            b.data = saved[1]
    best, best_err = None, math.inf
    for v in _variants(eps, b is not None):
        xv = x.clone().requires_grad_(True)
        wv = pw.clone().requires_grad_(True)
        bv = None if pb is None else pb.clone().requires_grad_(True)
        with torch.enable_grad():
            y = candidate(v, xv, wv, bv)
            err = _disagreement(own.detach(), y.detach())
            if err > 4 * _ulps(w.dtype):
                continue
            grads = torch.autograd.grad(y, (xv, wv) + ((bv,) if bv is not None else ()), dy, allow_unused=True)
        gerr = max(math.inf if (a is None) != (c is None) else 0.0 if a is None else _disagreement(a, c)
                   for a, c in zip(own_grads, grads))
        if gerr <= 8 * _ulps(w.dtype) and err < best_err:
            best, best_err = v, err
    if best is None:
        return None, "computes none of cukern's norms (RMSNorm, LayerNorm, their variants) to its dtype's rounding"
    return best, None
