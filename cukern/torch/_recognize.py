"""What a model's module computes, found by running it: ``patch(model)`` routes a module to a
cukern op only where the module's own forward and backward, on a small random input, agree with
what that op computes (one of its variants) to the dtype's rounding. A class name never decides.

Norms: a leaf module with a 1-D ``weight`` (and perhaps a 1-D ``bias``) whose forward maps one
(..., D) tensor to its shape, against RMSNorm with the weight or ``1 + weight`` (Gemma) in each
of cukern's casting modes (LLaMA's rounding of the normalized input before the weight, or float32
throughout), and LayerNorm with or without its bias; and a leaf module with no parameters or
buffers but an eps (nanochat's RMSNorm) against the norms without a weight, in float32, bfloat16
and float16 alike. The verdict is kept per (class, dtype, width, parameters, eps): modules of one
class and configuration are run once.

The loss: a ``*ForCausalLM`` (any module with an ``nn.Linear`` ``lm_head``, a base model under
its ``base_model_prefix`` and a forward that takes ``labels``) whose logits are the LM head of the
base model's last hidden state, times a scale (Granite's 1 / ``logits_scaling``) and through a
softcap (Gemma 2's ``final_logit_softcapping``) where its config names them: its own forward is
run once on a few tokens, in eval mode, against each candidate.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
import warnings

import torch
from torch import nn

from ..norm.configs import CASTING_MODES
from ._tools import uncounted


@dataclasses.dataclass(frozen=True)
class NormVariant:
    """A cukern norm: ``kind`` "rms" or "layer"; ``offset`` added to the weight (Gemma's 1);
    ``casting`` the RMSNorm casting mode's int (``CASTING_MODES``); ``bias`` whether LayerNorm
    adds the module's bias; ``eps`` the module's; ``mixed`` what a float32-weight module does with
    a 16-bit input (autocast's q/k projections, a sublayer's output): one of ``MIXED_FORMS``, or
    None where it was not found to do either (such calls then run its own code); ``weight``
    False for a norm without one (nanochat's), which computes the same for every input dtype."""
    kind: str
    offset: float
    casting: int
    bias: bool
    eps: float
    mixed: str | None = None
    weight: bool = True


# A float32 weight on a 16-bit input x: "llama" rounds the normalized x to x's dtype and multiplies
# by the float32 weight, a float32 result by PyTorch's type promotion (LLaMA's
# ``weight * x.to(input_dtype)``); "gemma" computes in float32 and rounds the result once to x's
# dtype (Gemma's ``type_as(x)``, OLMo 2's ``(weight * x).to(input_dtype)``); "float" computes in
# float32 and keeps the float32 result (T5's). LayerNorm: "gemma" and "float".
MIXED_FORMS = ("llama", "gemma", "float")


_EPS_NAMES = ("variance_epsilon", "eps", "epsilon", "rms_norm_eps", "layer_norm_eps")
_cache: dict[tuple, tuple[NormVariant | None, str | None]] = {}


def _eps_of(m: nn.Module) -> float | None:
    for name in _EPS_NAMES:
        v = getattr(m, name, None)
        if isinstance(v, (float, int)) and not isinstance(v, bool) and 0 < v < 1:
            return float(v)
    return None


def candidate(v: NormVariant, x: torch.Tensor, w: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor:
    """What cukern's op computes for variant ``v``, in PyTorch's ops (cukern/norm's documented
    arithmetic): float32 statistics; "gemma" rounds once at the end, "llama" rounds the
    normalized input to its dtype before the weight, "none" is PyTorch's rms_norm in the input's
    dtype. ``w`` None: no weight (every casting but "none" then rounds once)."""
    xf = x.float()
    wv = None if w is None else (w + v.offset if v.offset else w)
    if v.kind == "layer":
        mean = xf.mean(-1, keepdim=True)
        y = (xf - mean) * torch.rsqrt((xf - mean).pow(2).mean(-1, keepdim=True) + v.eps)
        y = y if w is None else y * (w.float() + v.offset)
        return (y + b.float() if v.bias and b is not None else y).to(x.dtype)
    if v.casting == CASTING_MODES["none"] and x.dtype != torch.float32:   # (PyTorch's rms_norm in x's dtype)
        return torch.nn.functional.rms_norm(x, x.shape[-1:], wv, v.eps)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + v.eps)
    if w is None:
        return y.to(x.dtype)
    if v.casting == CASTING_MODES["llama"]:
        return y.to(x.dtype) * wv
    return (y * (w.float() + v.offset)).to(x.dtype)


def mixed_candidate(form: str, v: NormVariant, x: torch.Tensor, w: torch.Tensor,
                    b: torch.Tensor | None) -> torch.Tensor:
    """What a module of variant ``v`` with float32 parameters computes of a 16-bit ``x`` in
    ``form`` (``MIXED_FORMS``), in PyTorch's ops."""
    xf = x.float()
    wf = w + v.offset if v.offset else w
    if v.kind == "layer":
        mean = xf.mean(-1, keepdim=True)
        y = (xf - mean) * torch.rsqrt((xf - mean).pow(2).mean(-1, keepdim=True) + v.eps)
    else:
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + v.eps)
    if form == "llama":
        return y.to(x.dtype) * wf
    y = y * wf
    y = y + b if v.kind == "layer" and v.bias and b is not None else y
    return y if form == "float" else y.to(x.dtype)


def _variants(eps: float, has_bias: bool) -> list[NormVariant]:
    out = [NormVariant("rms", off, CASTING_MODES[c], False, eps) for off in (0.0, 1.0)
           for c in ("gemma", "llama", "none")]
    out += [NormVariant("layer", off, 0, bias, eps) for off in (0.0, 1.0) for bias in ((True, False) if has_bias
                                                                                        else (False,))]
    return out


def _ulps(dtype: torch.dtype) -> float:
    return {torch.float32: 2.0**-20, torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}.get(dtype, 2.0**-20)


def _grads_disagreement(got, want) -> float:
    """The largest ``_disagreement`` over two lists of gradients (inf where one is None and the
    other is not)."""
    return max((math.inf if (a is None) != (c is None) else 0.0 if a is None else _disagreement(a, c)
                for a, c in zip(got, want)), default=0.0)


def _disagreement(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest difference relative to the reference's largest magnitude (inf for a NaN or a
    shape that differs)."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return math.inf
    d = (got.float() - want.float()).abs().max().item()
    return d / max(want.float().abs().max().item(), 1e-30) if math.isfinite(d) else math.inf


def weightless_shaped(m: nn.Module) -> bool:
    """Whether ``m`` looks enough like a norm without a weight (nanochat's RMSNorm) to be run to
    find out: a leaf with no parameters and no buffers (no state a probe could move, as a
    BatchNorm's running statistics) and an eps."""
    return (next(m.children(), None) is None and next(m.parameters(), None) is None
            and next(m.buffers(), None) is None and _eps_of(m) is not None)


def recognize_norm(m: nn.Module) -> tuple[NormVariant | None, str | None]:
    """(the cukern norm ``m`` computes, None) or (None, why not): run on a small random input of
    its weight's dtype and device, forward and backward, against every variant; a module without
    a weight as ``recognize_weightless_norm``."""
    w = getattr(m, "weight", None)
    if w is None and weightless_shaped(m):
        return recognize_weightless_norm(m)
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


_WEIGHTLESS_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def recognize_weightless_norm(m: nn.Module) -> tuple[NormVariant | None, str | None]:
    """(the cukern norm without a weight ``m`` computes, None) or (None, why not): with no
    parameter to tell the dtype of its inputs, ``m`` is run on float32, bfloat16 and float16
    inputs (the residual stream and autocast's projections hand it either), forward and backward,
    and routed to the variant that agrees with it in all three."""
    eps = _eps_of(m)
    width = _width_of(m)
    key = (type(m), None, width, eps, _settings(m))   # (its plain attributes: all it computes with)
    if key not in _cache:
        _cache[key] = _probe_weightless(m, eps, width)
    return _cache[key]


def _width_of(m: nn.Module) -> int:
    """The width to probe ``m`` at: the last of its ``normalized_shape`` where it names one (a
    module that checks its input's width), else any."""
    shape = getattr(m, "normalized_shape", None)
    if isinstance(shape, int):
        return shape
    if isinstance(shape, (tuple, list)) and shape and isinstance(shape[-1], int):
        return shape[-1]
    return 48


def _weightless_variants(eps: float) -> list[NormVariant]:
    # (without a weight "llama" rounds where "gemma" does: only "none" differs)
    return [NormVariant("rms", 0.0, CASTING_MODES[c], False, eps, weight=False) for c in ("gemma", "none")] + \
        [NormVariant("layer", 0.0, 0, False, eps, weight=False)]


def _probe_weightless(m: nn.Module, eps: float, d: int) -> tuple[NormVariant | None, str | None]:
    g = torch.Generator(device="cpu").manual_seed(0)
    x32 = torch.randn(2, 3, d, generator=g) * 3 + 0.5
    dy32 = torch.randn(2, 3, d, generator=g)
    worst = dict.fromkeys(_weightless_variants(eps), 0.0)   # variant -> its largest error over tolerance
    for dt in _WEIGHTLESS_DTYPES:
        x, dy = x32.to(dt), dy32.to(dt)
        own = _own_forward_and_dx(m, x, dy)
        if isinstance(own, str):
            return None, own
        y_own, dx_own = own
        for v in worst:
            xv = x.clone().requires_grad_(True)
            with torch.enable_grad():
                y = candidate(v, xv, None, None)
                dx, = torch.autograd.grad(y, xv, dy)
            worst[v] = max(worst[v], _disagreement(y_own, y.detach()) / (4 * _ulps(dt)),
                           _disagreement(dx_own, dx) / (8 * _ulps(dt)))
    best = min(worst, key=worst.get)
    if worst[best] > 1:
        return None, ("computes none of cukern's norms without a weight (RMSNorm, LayerNorm) to the rounding of "
                      "float32, bfloat16 and float16 alike")
    return best, None


def _own_forward_and_dx(m: nn.Module, x: torch.Tensor, dy: torch.Tensor):
    """(``m(x)``, its gradient with respect to x for ``dy``), or why ``m`` is no norm of x."""
    xl = x.clone().requires_grad_(True)
    with torch.enable_grad():
        try:
            y = m(xl)
        except Exception as e:  # noqa: BLE001 - any module: one that cannot run so is not a norm
            return f"its forward does not take one (..., {x.shape[-1]}) tensor ({type(e).__name__})"
        if not isinstance(y, torch.Tensor) or y.shape != x.shape:
            return "its forward does not map (..., D) to (..., D)"
        if not y.requires_grad:
            return "no gradient reaches its input"
        dx, = torch.autograd.grad(y, xl, dy.to(y.dtype))
    return y.detach(), dx


@contextlib.contextmanager
def _requiring_grad(params):
    """The parameters require a gradient for the block (a probe differentiates with respect to
    them; a frozen model's, as under LoRA, do not), and their own setting again after it."""
    saved = [(p, p.requires_grad) for p in params]
    try:
        for p, _ in saved:
            p.requires_grad_(True)
        yield
    finally:
        for p, r in saved:
            p.requires_grad_(r)


@contextlib.contextmanager
def _swapped(pairs):
    """Each (parameter, value): the parameter holds the probe's value (and requires a gradient)
    for the block, and its own again after it, whatever happens inside."""
    saved = [(p, p.data) for p, _ in pairs]
    try:
        for p, v in pairs:
            p.data = v
        with _requiring_grad([p for p, _ in pairs]):
            yield
    finally:
        for p, d in saved:
            p.data = d


def _probe_parameters(w, b, pw, pb):
    """The module's weight (and bias, where it has one) hold the probe's values for the block."""
    return _swapped([(w, pw)] + ([(b, pb)] if b is not None else []))


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
    with _probe_parameters(w, b, pw, pb), torch.enable_grad():
        xl = x.clone().requires_grad_(True)
        try:
            own = m(xl)
        except Exception as e:  # noqa: BLE001 - any module: one that cannot run so is not a norm
            return None, f"its forward does not take one (..., {d}) tensor ({type(e).__name__})"
        if not isinstance(own, torch.Tensor) or own.shape != x.shape:
            return None, "its forward does not map (..., D) to (..., D)"
        own_grads = torch.autograd.grad(own, (xl, w) + ((b,) if b is not None else ()), dy, allow_unused=True)
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
        if _grads_disagreement(own_grads, grads) <= 8 * _ulps(w.dtype) and err < best_err:
            best, best_err = v, err
    if best is None:
        return None, "computes none of cukern's norms (RMSNorm, LayerNorm, their variants) to its dtype's rounding"
    if w.dtype == torch.float32:
        best = dataclasses.replace(best, mixed=_probe_mixed(m, best, x, pw, pb, dy))
    return best, None


def _probe_mixed(m: nn.Module, v: NormVariant, x, pw, pb, dy) -> str | None:
    """The form (``MIXED_FORMS``) in which ``m``, of float32 parameters and variant ``v``,
    takes bfloat16 and float16 inputs (the result's dtype, values and gradients), or None. The
    forms differ by a rounding of the input's dtype, so the closest one is taken, and only within
    one such rounding (the modules that compute a form match it bit for bit on the CPU; one that
    keeps its statistics in the 16-bit dtype matches none)."""
    w, b = m.weight, getattr(m, "bias", None)
    found = set()
    for dt in (torch.bfloat16, torch.float16):
        x16, dy16 = x.to(dt), dy.to(dt)
        try:
            with _probe_parameters(w, b, pw, pb), torch.enable_grad():
                xl = x16.clone().requires_grad_(True)
                with warnings.catch_warnings():   # (F.rms_norm's note that it cannot fuse mixed dtypes)
                    warnings.simplefilter("ignore")
                    own = m(xl)
                if not isinstance(own, torch.Tensor) or own.shape != x.shape:
                    return None
                leaves = (xl, w) + ((b,) if b is not None else ())
                own_grads = torch.autograd.grad(own, leaves, dy16.to(own.dtype), allow_unused=True)
        except Exception:  # noqa: BLE001 - a module that refuses mixed dtypes keeps its own code for them
            return None
        best, best_err = None, math.inf
        for form in MIXED_FORMS if v.kind == "rms" else ("gemma", "float"):
            xv = x16.clone().requires_grad_(True)
            wv = pw.clone().requires_grad_(True)
            bv = None if pb is None else pb.clone().requires_grad_(True)
            with torch.enable_grad():
                y = mixed_candidate(form, v, xv, wv, bv)
                err = _disagreement(own.detach(), y.detach())
                if err > _ulps(dt) / 2 or err >= best_err:
                    continue
                grads = torch.autograd.grad(y, (xv, wv) + ((bv,) if bv is not None else ()), dy16.to(y.dtype),
                                            allow_unused=True)
            if _grads_disagreement(own_grads, grads) <= 8 * _ulps(dt):
                best, best_err = form, err
        if best is None or (found and best not in found):
            return None
        found = {best}
    return found.pop()


# ---- gated MLPs ---------------------------------------------------------------------------------

# activation -> (cukern.torch's gated function, its keyword arguments, PyTorch's activation)
GATED_ACTS = {"silu": ("swiglu", {}, torch.nn.functional.silu),
              "gelu": ("geglu", {}, torch.nn.functional.gelu),
              "gelu_tanh": ("geglu", {"approximate": "tanh"},
                            lambda g: torch.nn.functional.gelu(g, approximate="tanh"))}


@dataclasses.dataclass(frozen=True)
class GatedMLP:
    """``down(act(gate(x)) * up(x))``: the children's names; ``gate == up`` for one fused
    projection whose output holds the gate's half first (``gate_first``) or second."""
    gate: str
    up: str
    down: str
    act: str
    gate_first: bool = True

    @property
    def fused(self) -> bool:
        return self.gate == self.up

    def halves(self, m: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate, up) projections of ``x`` by ``m``'s children."""
        if self.fused:
            a, b = getattr(m, self.gate)(x).chunk(2, dim=-1)
            return (a, b) if self.gate_first else (b, a)
        return getattr(m, self.gate)(x), getattr(m, self.up)(x)


def _child_activations(m: nn.Module) -> set[str]:
    """The activations (GATED_ACTS' names) that ``m``'s parameter-free children compute, told
    apart in float32 (in bfloat16 erf-GELU and tanh-GELU differ by less than a rounding)."""
    x = torch.linspace(-6.0, 6.0, 97)
    found = set()
    for c in m.children():
        if any(True for _ in c.parameters()):
            continue
        try:
            y = c(x)
        except Exception:  # noqa: BLE001 - not an elementwise function of one tensor
            continue
        for name, (_, _, act) in GATED_ACTS.items():
            if isinstance(y, torch.Tensor) and y.shape == x.shape and torch.allclose(y, act(x), rtol=1e-6, atol=1e-6):
                found.add(name)
    return found


def _mlp_candidates(m: nn.Module) -> list[GatedMLP]:
    lin = {n: c for n, c in m.named_children() if isinstance(c, nn.Linear)}
    others = [c for n, c in m.named_children() if n not in lin]
    if any(any(True for _ in c.parameters()) for c in others) or len(lin) not in (2, 3):
        return []
    shapes = {n: (c.in_features, c.out_features) for n, c in lin.items()}
    # (an activation module among the children decides it; else every one is tried)
    acts = _child_activations(m) or set(GATED_ACTS)
    out = []
    for down, (i_down, o_down) in shapes.items():
        ins = [n for n in lin if n != down and shapes[n] == (o_down, i_down)]
        fused = [n for n in lin if n != down and shapes[n] == (o_down, 2 * i_down)]
        for act in (a for a in GATED_ACTS if a in acts):
            if len(lin) == 3 and len(ins) == 2:
                out += [GatedMLP(ins[0], ins[1], down, act), GatedMLP(ins[1], ins[0], down, act)]
            if len(lin) == 2 and len(fused) == 1:
                out += [GatedMLP(fused[0], fused[0], down, act, first) for first in (True, False)]
    return out


def _mlp_reference(spec: GatedMLP, m: nn.Module, x: torch.Tensor) -> torch.Tensor:
    g, u = spec.halves(m, x)
    return getattr(m, spec.down)(GATED_ACTS[spec.act][2](g) * u)


def _settings(m: nn.Module) -> tuple:
    """What besides its class and shapes can change what a module computes: its plain
    attributes (a clamp's limit, ...) and its activation module (from the config's hidden_act)."""
    plain = tuple(sorted((k, v) for k, v in vars(m).items()
                         if not k.startswith("_") and isinstance(v, (bool, int, float, str, type(None)))))
    return plain, repr(getattr(m, "act_fn", None))


def recognize_mlp(m: nn.Module) -> tuple[GatedMLP | None, str | None]:
    """(the gated MLP ``m`` computes, None) or (None, why not): ``m``'s Linear children taken as
    gate, up and down (or a fused gate-and-up) in every order their shapes allow and every
    activation cukern has, run against ``m`` forward and backward on a small random input."""
    specs = _mlp_candidates(m)
    if not specs:
        return None, "not two or three Linear children of a gated MLP's shapes"
    first = next(m.parameters())
    key = (type(m), first.dtype, tuple((n, tuple(p.shape)) for n, p in m.named_parameters()), _settings(m))
    if key not in _cache:
        _cache[key] = _probe_mlp(m, specs)
    return _cache[key]


def _probe_mlp(m: nn.Module, specs: list[GatedMLP]) -> tuple[GatedMLP | None, str | None]:
    params = [p for p in m.parameters()]
    w = params[0]
    hidden = getattr(m, specs[0].down).out_features
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(2, 3, hidden, generator=g).to(device=w.device, dtype=w.dtype)
    dy = torch.randn(2, 3, hidden, generator=g).to(device=w.device, dtype=w.dtype)
    with _requiring_grad(params), torch.enable_grad():
        xl = x.clone().requires_grad_(True)
        try:
            own = m(xl)
        except Exception as e:  # noqa: BLE001 - a module that cannot run so is no MLP
            return None, f"its forward does not take one (..., {hidden}) tensor ({type(e).__name__})"
        if not isinstance(own, torch.Tensor) or own.shape != x.shape:
            return None, "its forward does not map (..., hidden) to (..., hidden)"
        own_grads = torch.autograd.grad(own, [xl, *params], dy, allow_unused=True)
    best, best_err = None, math.inf
    for spec in specs:
        with torch.enable_grad():
            xv = x.clone().requires_grad_(True)
            y = _mlp_reference(spec, m, xv)
            err = _disagreement(own.detach(), y.detach())
            if err > 8 * _ulps(w.dtype):
                continue
            grads = torch.autograd.grad(y, [xv, *params], dy, allow_unused=True)
        if _grads_disagreement(own_grads, grads) <= 16 * _ulps(w.dtype) and err < best_err:
            best, best_err = spec, err
    if best is None:
        return None, "computes no gated MLP (silu, gelu or tanh-gelu) cukern has to its dtype's rounding"
    return best, None


# ---- rotary embeddings ----------------------------------------------------------------------------

_rope_cache: dict[tuple, tuple[str | None, bool]] = {}


class _Refused(Exception):
    """The modeling function does not take the probe's arguments (the exception's name)."""


def _outputs_agree(fn, ours, tensors, tables) -> bool:
    """Whether ``fn(*tensors, *tables)`` and ``ours(...)`` give the same results (values, dtypes,
    and the tensors' gradients) to the tensors' dtype's rounding; ``_Refused`` where ``fn``
    does not take them. A result is one tensor or a tuple of them."""
    def results(f, leaves):
        out = f(*leaves, *tables)
        return (out,) if torch.is_tensor(out) else tuple(out)

    with torch.enable_grad():
        leaves = [t.clone().requires_grad_(True) for t in tensors]
        try:
            own = results(fn, leaves)
        except Exception as e:  # noqa: BLE001 - another signature: not this rotary embedding
            raise _Refused(type(e).__name__) from None
        if not all(torch.is_tensor(t) and t.requires_grad for t in own):   # (no rotation of its inputs)
            return False
        dys = [torch.randn(t.shape, generator=torch.Generator().manual_seed(3)).to(t) for t in own]
        own_grads = torch.autograd.grad(own, leaves, dys)
        mine_leaves = [t.clone().requires_grad_(True) for t in tensors]
        mine = results(ours, mine_leaves)
        grads = torch.autograd.grad(mine, mine_leaves, [d.to(t.dtype) for d, t in zip(dys, mine)])
    if len(mine) != len(own):
        return False
    errs = [_disagreement(a, b) for a, b in zip((*own, *own_grads), (*mine, *grads))]
    return max(errs) <= 4 * _ulps(tensors[0].dtype)


_NOT_CUKERNS = "its rotation is not cukern's rope (half-split or interleaved) to the dtype's rounding"
QK_REFUSED = "its apply_rotary_pos_emb does not take (q, k, cos, sin)"


def rope_of(fn, ours, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> str | None:
    """None where a modeling module's ``apply_rotary_pos_emb`` ``fn`` and cukern's ``ours`` give
    the same q and k (values, dtypes and gradients) on these inputs, else why not."""
    try:
        return None if _outputs_agree(fn, ours, (q, k), (cos, sin)) else _NOT_CUKERNS
    except _Refused as e:
        return f"{QK_REFUSED} ({e})"


def recognize_rope(modname: str, fn, wrap, device, dtype) -> tuple[str | None, bool, bool, bool, str, bool]:
    """(None, rounds, partial, half, interleave, negate) where modeling module ``modname``'s
    ``apply_rotary_pos_emb`` ``fn`` is cukern's rope, else (why not, False, False, False, "", False): run
    once per module and dtype on random q, k (2, 3, 5, 16) and full-width tables of q's dtype,
    and, for 16-bit q, float32 tables (as autocast makes them). ``rounds``: ``fn`` rounds its
    result to q's dtype there (OLMo 2's), where PyTorch's promotion gives float32 (LLaMA's);
    ``partial``: with tables narrower than the head, ``fn`` rotates the first dims and passes the
    rest (GPT-NeoX's ``rotary_pct``); ``half``: ``fn`` takes tables of half the head's width, one
    angle a pair (GPT-OSS's), and no full-width ones; ``interleave``: ``fn`` rotates pairs (2i,
    2i + 1), "paired" with tables that repeat each angle in place (Cohere's), "split" making such
    tables from Hugging Face's half-split ones (GLM's); ``negate``: ``fn`` rotates the other way
    (nanochat's: its rotate_half gives (x2, -x1)), which is cukern's rope with sin negated.
    ``wrap(rounds, partial, half, interleave, negate)`` is the function to check."""
    key = (modname, str(device), dtype)
    if key not in _rope_cache:
        g = torch.Generator().manual_seed(0)
        q, k = (torch.randn(2, h, 5, 16, generator=g).to(device=device, dtype=dtype) for h in (3, 1))
        angles = torch.rand(2, 5, 8, generator=g) * 6

        def tables(n: int, form: str):   # (cos, sin) of the first n angles, as ``form`` lays them out
            a = angles[..., :n]
            if form == "half":
                return tuple(f(a).to(device=device) for f in (torch.cos, torch.sin))
            if form == "paired":
                return tuple(f(a).repeat_interleave(2, dim=-1).to(device=device) for f in (torch.cos, torch.sin))
            return tuple(torch.cat([f(a)] * 2, -1).to(device=device) for f in (torch.cos, torch.sin))

        first_why, found = None, None
        for half, interleave, negate in ((False, "", False), (True, "", False), (False, "paired", False),
                                         (False, "split", False), (False, "", True), (False, "paired", True)):
            cos32, sin32 = tables(8, "half" if half else interleave)
            rounds = False
            if dtype != torch.float32:
                try:
                    rounds = fn(q, k, cos32, sin32)[0].dtype == dtype
                except Exception:  # noqa: BLE001 - told by rope_of below
                    pass
            with uncounted():
                ours = wrap(rounds, False, half, interleave, negate)
                why = rope_of(fn, ours, q, k, cos32.to(dtype), sin32.to(dtype))
                if why is None and dtype != torch.float32:
                    why = rope_of(fn, ours, q, k, cos32, sin32)
            first_why = first_why or why
            if why is None:
                found = (rounds, half, interleave, negate)
                break
        if found is None:
            _rope_cache[key] = (first_why, False, False, False, "", False)
        else:
            rounds, half, interleave, negate = found
            partial = False
            if not half:   # (a quarter of the head rotated, as GPT-NeoX's default rotary_pct)
                c4, s4 = tables(2, interleave)
                with uncounted():
                    partial = all(rope_of(fn, wrap(rounds, True, False, interleave, negate), q, k, c4.to(dtype=dt),
                                          s4.to(dtype=dt)) is None
                                  for dt in {dtype, torch.float32})
            _rope_cache[key] = (None, rounds, partial, half, interleave, negate)
    return _rope_cache[key]


@dataclasses.dataclass(frozen=True)
class OneTensorRope:
    """A modeling module's rope of one tensor a call, ``fn(x, a, b)`` with two tables (GPT-J's
    and CodeGen's ``(tensor, sin, cos)``, called for q and for k apart, their attention slicing
    the rotated dims and passing the rest on itself): ``sin_first`` the tables' order;
    ``seq_first`` x laid out (B, S, H, D), as the projections are before their transpose, else
    (B, H, S, D); ``half`` tables of half x's width, one angle a pair (GPT-J's), else full width;
    ``interleaved`` pairs (2i, 2i + 1), else (j, j + D/2) (full-width interleaved tables repeat
    each angle in place, as Cohere's); ``rounds`` as ``recognize_rope``'s."""
    sin_first: bool
    seq_first: bool
    half: bool
    interleaved: bool
    rounds: bool = False


ONE_TENSOR_FORMS = tuple(OneTensorRope(sin_first, seq_first, half, interleaved)
                         for interleaved in (True, False) for half in (True, False)
                         for sin_first in (True, False) for seq_first in (True, False))

_rope_one_cache: dict[tuple, tuple[OneTensorRope | None, str | None]] = {}


def _tables_in_form(angles: torch.Tensor, form: OneTensorRope, device):
    """(the first table, the second) of ``angles`` as a function of ``form`` takes them."""
    def table(f):
        t = f(angles)
        if not form.half:
            t = t.repeat_interleave(2, dim=-1) if form.interleaved else torch.cat([t, t], -1)
        return t.to(device=device)
    cos, sin = table(torch.cos), table(torch.sin)
    return (sin, cos) if form.sin_first else (cos, sin)


def recognize_rope_one(modname: str, fn, wrap, device, dtype) -> tuple[OneTensorRope | None, str | None]:
    """(the ``OneTensorRope`` form in which modeling module ``modname``'s
    ``apply_rotary_pos_emb`` ``fn`` is cukern's rope, None) or (None, why not): each form run
    once per module and dtype on a random x (2, 3 heads, 5, 16) with tables of x's dtype and,
    for 16-bit x, float32 tables (as autocast makes them), forward and backward, against
    ``wrap(form)``, the function to check."""
    key = (modname, str(device), dtype)
    if key not in _rope_one_cache:
        _rope_one_cache[key] = _probe_rope_one(fn, wrap, device, dtype)
    return _rope_one_cache[key]


def _probe_rope_one(fn, wrap, device, dtype) -> tuple[OneTensorRope | None, str | None]:
    g = torch.Generator().manual_seed(0)
    angles = torch.rand(2, 5, 8, generator=g) * 6
    x_heads_first = torch.randn(2, 3, 5, 16, generator=g).to(device=device, dtype=dtype)
    refused, ran = None, False
    for form in ONE_TENSOR_FORMS:
        # (x and the tables are laid out as ``form`` says: the wrapper takes them, so a form that
        # is not fn's differs rather than falling back to fn)
        x = x_heads_first.transpose(1, 2).contiguous() if form.seq_first else x_heads_first
        tables32 = _tables_in_form(angles, form, device)
        rounds = False
        if dtype != torch.float32:
            try:
                rounds = fn(x, *tables32).dtype == dtype
            except Exception:  # noqa: BLE001 - told below
                pass
        form = dataclasses.replace(form, rounds=rounds)
        try:
            with uncounted():
                ours = wrap(form)
                same = all(_outputs_agree(fn, ours, (x,), tuple(t.to(dt) for t in tables32))
                           for dt in dict.fromkeys((dtype, torch.float32)))
        except _Refused as e:
            refused = refused or str(e)
            continue
        if same:
            return form, None
        ran = True
    return None, _NOT_CUKERNS if ran else \
        f"its apply_rotary_pos_emb takes neither (q, k, cos, sin) nor (x, cos, sin) ({refused})"


# ---- the LM head: logits from the base model's last hidden state --------------------------------

@dataclasses.dataclass(frozen=True)
class LMHead:
    """logits = softcap * tanh(lm_head(h) * scale / softcap) (no tanh where softcap is None)."""
    scale: float = 1.0
    softcap: float | None = None


_lm_cache: dict[tuple, tuple[LMHead | None, str | None]] = {}


def _number(v) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v and v != 1 else None


def _lm_candidates(m: nn.Module) -> list[LMHead]:
    """The scales and caps the logits may carry: Granite's 1 / logits_scaling, Cohere's
    logit_scale (the module's or its config's), Gemma 2's final softcap."""
    cfg = getattr(m, "config", None)
    scaling = _number(getattr(cfg, "logits_scaling", None))
    times = _number(getattr(m, "logit_scale", getattr(cfg, "logit_scale", None)))
    cap = getattr(cfg, "final_logit_softcapping", None)
    cap = float(cap) if isinstance(cap, (int, float)) and cap and cap > 0 else None
    scales = [s for s in (1.0 / scaling if scaling else None, times) if s is not None] + [1.0]
    out = [LMHead(s, c) for s in scales for c in (cap, None)]
    return list(dict.fromkeys(out))


def recognize_lm_head(m: nn.Module) -> tuple[LMHead | None, str | None]:
    """(how ``m``'s logits come from its base model's last hidden state, None) or (None, why
    not), for a causal LM's loss without logits (see the module's docstring)."""
    head = getattr(m, "lm_head", None)
    prefix = getattr(m, "base_model_prefix", None)
    base = getattr(m, prefix, None) if isinstance(prefix, str) and prefix else None
    if not isinstance(head, nn.Linear):
        return None, "no nn.Linear lm_head"
    if not isinstance(base, nn.Module):
        return None, "no base model under its base_model_prefix"
    if "labels" not in inspect.signature(type(m).forward).parameters:
        return None, "its forward takes no labels"
    cands = _lm_candidates(m)
    key = (type(m), head.weight.dtype, head.weight.shape, head.bias is not None, tuple(cands))
    if key not in _lm_cache:
        _lm_cache[key] = _probe_lm(m, base, head, cands)
    return _lm_cache[key]


def _probe_lm(m: nn.Module, base: nn.Module, head: nn.Linear, cands: list[LMHead]):
    ids = torch.randint(0, head.out_features, (1, 5), generator=torch.Generator().manual_seed(0)).to(head.weight.device)
    was = m.training
    m.eval()   # (dropout off: the two runs must see the same network)
    try:
        with torch.no_grad(), uncounted():
            own = type(m).forward(m, input_ids=ids, return_dict=True).logits
            hidden = base(input_ids=ids, return_dict=True).last_hidden_state
            raw = head(hidden).float()
    except Exception as e:  # noqa: BLE001 - a forward of another shape: not a causal LM's
        return None, f"its forward on input_ids alone failed ({type(e).__name__})"
    finally:
        m.train(was)
    if own is None or own.shape != raw.shape:
        return None, "its logits are not the LM head's of the last hidden state"
    tol = 8 * _ulps(head.weight.dtype)
    for c in cands:
        x = raw * c.scale
        if c.softcap is not None:
            x = torch.tanh(x / c.softcap) * c.softcap
        if _disagreement(x, own.float()) <= tol:
            return c, None
    return None, "its logits are not the LM head's of the last hidden state (scaled, capped) to the dtype's rounding"


# ---- embeddings: a lookup, perhaps scaled -----------------------------------------------------------

_embedding_cache: dict[tuple, tuple[float | None, str | None]] = {}


def recognize_embedding(m: nn.Module) -> tuple[float | None, str | None]:
    """(the scale ``m``'s output is the lookup times, None) or (None, why not): an
    ``nn.Embedding`` with its own forward (Gemma's scaled word embeddings multiply by
    sqrt(hidden) in the weight's dtype) is run once per class, dtype and width on a few indices."""
    if type(m).forward is nn.Embedding.forward:
        return 1.0, None
    w = m.weight
    key = (type(m), w.dtype, w.shape[1], float(getattr(m, "embed_scale", 1.0)))
    if key not in _embedding_cache:
        ids = torch.arange(min(m.num_embeddings, 7), device=w.device)[None]
        try:
            with torch.no_grad(), uncounted():
                own = m(ids)
                look = nn.functional.embedding(ids, w, m.padding_idx)
        except Exception as e:  # noqa: BLE001 - another signature: not an embedding's
            _embedding_cache[key] = None, f"its forward on indices alone failed ({type(e).__name__})"
        else:
            scale = getattr(m, "embed_scale", 1.0)
            scale = float(scale.item() if torch.is_tensor(scale) else scale)
            # (the scale rounded to the weight's dtype, as Gemma multiplies)
            want = look * torch.tensor(scale, dtype=w.dtype, device=w.device)
            ok = own.dtype == want.dtype and _disagreement(own, want) <= _ulps(w.dtype)
            _embedding_cache[key] = (scale, None) if ok else (None, "its output is not the lookup times one scale")
    return _embedding_cache[key]


# ---- activations written out by hand ------------------------------------------------------------

_activation_cache: dict[type, str | None] = {}


def recognize_tanh_gelu(m: nn.Module) -> bool:
    """Whether ``m``, a parameterless leaf module that is not one of PyTorch's own (whose code
    is PyTorch's kernels already), computes the tanh GELU (GPT-2's ``gelu_new`` written out as
    0.5 x (1 + tanh(...)) in several elementwise kernels): run once per class, in eval mode, on
    random float32 values."""
    if type(m).__module__.startswith("torch.") or next(m.children(), None) is not None \
            or next(m.parameters(), None) is not None or next(m.buffers(), None) is not None:
        return False
    if type(m) not in _activation_cache:
        x = torch.randn(4, 33, generator=torch.Generator().manual_seed(0)) * 3
        was = m.training
        m.eval()
        try:
            with torch.no_grad(), uncounted():
                y = m(x)
            want = nn.functional.gelu(x, approximate="tanh")
            ok = torch.is_tensor(y) and _disagreement(y, want) <= 2 * _ulps(x.dtype)
        except Exception:  # noqa: BLE001 - not an elementwise module of one tensor
            ok = False
        finally:
            m.train(was)
        _activation_cache[type(m)] = "tanh GELU" if ok else None
    return _activation_cache[type(m)] is not None
