"""Finding, by running them, the experts of an MoE block that cukern's kernels compute:
transformers' fused experts (Mixtral's, Qwen3-MoE's, OLMoE's) and the biased experts with a
clamped gate (GPT-OSS's), as ``_recognize`` finds norms, gated MLPs and rotary embeddings."""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from ._recognize import GATED_ACTS, _disagreement, _grads_disagreement, _settings, _swapped, _ulps


@dataclasses.dataclass(frozen=True)
class Experts:
    """transformers' fused experts (Mixtral's, Qwen3-MoE's, OLMoE's): ``forward(x (T, H),
    top_k_index (T, k), top_k_weights (T, k))`` = each token's sum over its k experts e of its
    weight times ``down_proj[e] @ (act(gate) * up)``, ``(gate, up) = gate_up_proj[e] @ x``
    (the gate's I rows first)."""
    act: str


@dataclasses.dataclass(frozen=True)
class BiasedExperts:
    """GPT-OSS's experts: ``forward(x (T, H), top_k_index, top_k_weights)`` = each token's sum
    over its k experts e of its weight times ``z @ down_proj[e] + down_proj_bias[e]``, ``z = (u +
    1) * g * sigmoid(alpha * g)``, ``g = min(h[0::2], limit)``, ``u = clamp(h[1::2], -limit,
    limit)``, ``h = x @ gate_up_proj[e] + gate_up_proj_bias[e]`` (weights held (E, in, out))."""
    alpha: float
    limit: float


BIASES = ("down_proj_bias", "gate_up_proj_bias")


def experts_shaped(m: nn.Module) -> bool:
    """Holds 3-D ``gate_up_proj`` and ``down_proj`` parameters: a candidate for ``recognize_experts``."""
    gu, dn = getattr(m, "gate_up_proj", None), getattr(m, "down_proj", None)
    return isinstance(gu, nn.Parameter) and isinstance(dn, nn.Parameter) and gu.ndim == 3 and dn.ndim == 3


_experts_cache: dict[tuple, tuple[Experts | None, str | None]] = {}


def recognize_experts(m: nn.Module) -> tuple[Experts | BiasedExperts | None, str | None]:
    """(the ``Experts`` or ``BiasedExperts`` ``m`` computes, None) or (None, why not): ``m`` run
    on a small random input with random weights, in float32, against each form cukern's products
    take, forward and backward (x, the weights and every parameter)."""
    gu, dn = m.gate_up_proj, m.down_proj
    others = sorted(n for n, _ in m.named_parameters() if n not in ("gate_up_proj", "down_proj"))
    if tuple(others) == BIASES:
        return _recognize_biased(m)
    if others:
        return None, f"its experts have other parameters ({', '.join(others)}): biases are not in the products"
    e, two_i, h = gu.shape
    if two_i % 2 or dn.shape != (e, h, two_i // 2):
        return None, (f"its weights are {tuple(gu.shape)} and {tuple(dn.shape)}, not (E, 2I, H) and (E, H, I) "
                      "(transposed or interleaved layouts are not taken)")
    own_gate = getattr(type(m), "_apply_gate", None)
    if own_gate is not None:
        from transformers.integrations.moe import _default_apply_gate

        if own_gate is not _default_apply_gate:
            return None, "its gate is its own (_apply_gate: a clamp or another form), not act(gate) * up"
    key = (type(m), tuple(gu.shape), _settings(m))
    if key not in _experts_cache:
        _experts_cache[key] = _probe_experts(m, e, two_i // 2, h)
    return _experts_cache[key]


def experts_reference(act: str, x, top_k_index, top_k_weights, gate_up, down):
    """What ``Experts(act)`` computes, in PyTorch ops (the probe's candidate, and the path where
    the kernels do not run): (T, H) in x's dtype."""
    hid = torch.einsum("th,tkoh->tko", x, gate_up[top_k_index])
    i = hid.shape[-1] // 2
    z = GATED_ACTS[act][2](hid[..., :i]) * hid[..., i:]
    y = torch.einsum("tki,tkhi->tkh", z, down[top_k_index])
    return (y * top_k_weights[..., None]).sum(1).to(x.dtype)


def biased_experts_reference(alpha: float, limit: float, x, top_k_index, top_k_weights, gate_up, gate_up_bias, down,
                             down_bias):
    """What ``BiasedExperts(alpha, limit)`` computes (GPT-OSS's experts), in PyTorch ops: (T, H)
    in x's dtype. gate_up (E, H, 2I), gate and up columns interleaved; down (E, I, H)."""
    hid = torch.einsum("th,tkho->tko", x, gate_up[top_k_index]) + gate_up_bias[top_k_index]
    g, u = hid[..., 0::2].clamp(max=limit), hid[..., 1::2].clamp(-limit, limit)
    z = (u + 1) * g * torch.sigmoid(alpha * g)
    # (z cast to the weights' dtype, as autocast casts the next product's inputs)
    y = torch.einsum("tki,tkih->tkh", z.to(down.dtype), down[top_k_index]) + down_bias[top_k_index]
    return (y * top_k_weights[..., None]).sum(1).to(x.dtype)


def _recognize_biased(m: nn.Module) -> tuple[BiasedExperts | None, str | None]:
    gu, dn, bgu, bdn = m.gate_up_proj, m.down_proj, m.gate_up_proj_bias, m.down_proj_bias
    e, h, two_i = gu.shape
    if two_i % 2 or dn.shape != (e, two_i // 2, h) or bgu.shape != (e, two_i) or bdn.shape != (e, h):
        return None, (f"its weights and biases are {tuple(gu.shape)}, {tuple(bgu.shape)}, {tuple(dn.shape)} and "
                      f"{tuple(bdn.shape)}, not (E, H, 2I), (E, 2I), (E, I, H) and (E, H)")
    alpha, limit = getattr(m, "alpha", None), getattr(m, "limit", None)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in (alpha, limit)):
        return None, "its biased experts hold no positive alpha and limit (the clamped gate's)"
    spec = BiasedExperts(float(alpha), float(limit))
    key = (type(m), tuple(gu.shape), _settings(m))
    if key not in _experts_cache:
        _experts_cache[key] = _probe_biased(m, spec, e, two_i // 2, h)
    return _experts_cache[key]


def _probe_biased(m: nn.Module, spec: BiasedExperts, e: int, i: int, h: int):
    """Found where ``m`` gives the reference's output and gradients at two input sizes: gate
    inputs of unit size, and of about twice the limit (where the clamps cut)."""
    dev = m.gate_up_proj.device
    g = torch.Generator(device="cpu").manual_seed(0)
    t, k = 6, min(2, e)
    params = [m.gate_up_proj, m.gate_up_proj_bias, m.down_proj, m.down_proj_bias]
    for scale in (1.0, 2.0 * spec.limit):
        idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(dev)
        w = (torch.rand(t, k, generator=g) + 0.1).to(dev)
        x = torch.randn(t, h, generator=g).to(dev)
        values = [(torch.randn(e, h, 2 * i, generator=g) * scale / h ** 0.5).to(dev),
                  torch.randn(e, 2 * i, generator=g).to(dev),
                  (torch.randn(e, i, h, generator=g) / i ** 0.5).to(dev),
                  torch.randn(e, h, generator=g).to(dev)]
        dy = torch.randn(t, h, generator=g).to(dev)
        own, own_grads, why = _own_run(m, params, values, x, idx, w, dy)
        if why is not None:
            return None, why
        reference = lambda x, w, *p, idx=idx: biased_experts_reference(spec.alpha, spec.limit, x, idx, w, *p)  # noqa: E731
        if not _agrees(own, own_grads, reference, [x, w, *values], dy):
            return None, (f"computes no biased experts with the clamped gate (alpha {spec.alpha:g}, limit "
                          f"{spec.limit:g}) to float32's rounding")
    return spec, None


def _probe_experts(m: nn.Module, e: int, i: int, h: int) -> tuple[Experts | None, str | None]:
    """Found only where one activation matches at both scales: inputs of unit size (where the
    activations differ) and of about 30 (where a clamp of the gate would show)."""
    found = None
    for scale in (1.0, 30.0):
        act, why = _probe_experts_at(m, e, i, h, scale)
        if act is None or (found is not None and act != found):
            return None, why or "computes no one gated-experts form at every input size"
        found = act
    return Experts(found), None


def _probe_experts_at(m: nn.Module, e: int, i: int, h: int, scale: float) -> tuple[str | None, str | None]:
    dev = m.gate_up_proj.device
    g = torch.Generator(device="cpu").manual_seed(0)
    t, k = 6, min(2, e)
    x = (torch.randn(t, h, generator=g) * scale).to(dev)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(dev)
    w = (torch.rand(t, k, generator=g) + 0.1).to(dev)
    pgu = (torch.randn(e, 2 * i, h, generator=g) / h ** 0.5).to(dev)
    pdn = (torch.randn(e, h, i, generator=g) / i ** 0.5).to(dev)
    dy = torch.randn(t, h, generator=g).to(dev)
    own, own_grads, why = _own_run(m, [m.gate_up_proj, m.down_proj], [pgu, pdn], x, idx, w, dy)
    if why is not None:
        return None, why
    for act in GATED_ACTS:
        reference = lambda x, w, gu, dn, act=act: experts_reference(act, x, idx, w, gu, dn)   # noqa: E731
        if _agrees(own, own_grads, reference, [x, w, pgu, pdn], dy):
            return act, None
    return None, "computes no gated experts (silu, gelu or tanh-gelu) cukern has to float32's rounding"


def _own_run(m: nn.Module, params, values, x, idx, w, dy):
    """``m(x, idx, w)`` with ``params`` holding ``values``: (its output, the gradients of x, w and
    ``params`` against ``dy``, None), or (None, None, why not)."""
    with _swapped(list(zip(params, values))), torch.enable_grad():
        xl, wl = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        try:
            own = m(xl, idx, wl)
        except Exception as ex:  # noqa: BLE001 - a module that cannot run so is not such experts
            return None, None, f"its forward does not take (x, top_k_index, top_k_weights) ({type(ex).__name__})"
        if not isinstance(own, torch.Tensor) or own.shape != x.shape:
            return None, None, "its forward does not map (T, H) to (T, H)"
        return own.detach(), torch.autograd.grad(own, [xl, wl, *params], dy, allow_unused=True), None


def _agrees(own, own_grads, reference, values, dy) -> bool:
    """``reference(*values)`` and its gradients (of every value, against ``dy``) are ``own`` and
    ``own_grads`` to float32's rounding."""
    with torch.enable_grad():
        leaves = [v.clone().requires_grad_(True) for v in values]
        y = reference(*leaves)
        if _disagreement(own, y.detach()) > 8 * _ulps(torch.float32):
            return False
        grads = torch.autograd.grad(y, leaves, dy, allow_unused=True)
    return _grads_disagreement(own_grads, grads) <= 16 * _ulps(torch.float32)
