"""``patch(model)``: route a model's own code to cukern, with no change to the model's code and
its state_dict unchanged.

Hugging Face ``transformers`` models write their norms, rotary embedding and gated MLP by hand
(``LlamaRMSNorm.forward`` is a handful of tensor ops), so patching ``torch.nn.functional`` does
not reach them. ``patch(model)`` routes, module by module:

* ``norm``: ``nn.LayerNorm`` and ``nn.RMSNorm`` modules, and any module that computes one of
  cukern's norms, found by running it (``_recognize``): RMSNorm with the weight or Gemma's
  ``1 + weight``, in LLaMA's rounding (x̂ rounded to the input's dtype before the weight) or in
  float32 throughout, and LayerNorm with or without its bias (Qwen3's and OLMo 2's QK-norms,
  Gemma's norms before and after each sublayer, ...); and norms without a weight (nanochat's
  RMSNorm: a leaf with no parameters or buffers and an eps, found in float32, bfloat16 and
  float16 alike);
* ``embedding``: ``nn.Embedding`` modules;
* ``mlp``: any module found to compute a gated MLP (``down(act(gate(x)) * up(x))``, silu, gelu or
  tanh-gelu; separate or fused gate and up projections, as Phi-3's ``gate_up_proj``) with the
  product in one kernel (``_recognize``);
  GPT-2's ``gelu_new`` (a chain of eight elementwise ops in eager) as PyTorch's one tanh-GELU
  kernel, the same function computed in float32 (as torch.compile computes it);
* ``rope``: ``apply_rotary_pos_emb`` of each modeling module the model's classes come from, where
  it computes cukern's rope, forward and backward, on a small random input: half-split, or
  interleaved pairs (Cohere's with tables that repeat each angle in place; GLM's, Ernie 4.5's and
  Helium's made so from half-split tables); partial rotary tables (GPT-NeoX's ``rotary_pct``,
  GLM's) where it is found to pass the dims past them on, and half-width tables (GPT-OSS's) where
  it takes those alone; a function of one tensor a call (GPT-J's and CodeGen's ``(tensor, sin,
  cos)``, half-width tables, interleaved pairs) where it is found so; other calls go to the
  module's own function;
* ``attention``: the model's attention implementation ("cukern", registered with transformers'
  AttentionInterface, with its mask function; in ``_transformers_attention``): causal masks run
  causal, padding masks and packed documents (position ids that restart) as varlen, a sliding
  window (a windowed layer's mask read for it) as a window, GPT-OSS's sinks with the sinks,
  dropout where the SDPA drop-in takes it (Hopper, head dims 64 and 128, without padding or
  documents); other masks, other dropout and cached decoding go to PyTorch's SDPA (the model's
  eager code for a softcap or sinks), counted;
* ``loss``: the LM head and the loss of a causal LM (``*ForCausalLM``, GPT-2's LM head) in
  training with labels, where its logits are found to be the LM head of the base model's last
  hidden state (scaled by Granite's ``logits_scaling`` or Cohere's ``logit_scale``, capped by
  Gemma 2's ``final_logit_softcapping``): ``linear_cross_entropy`` on that hidden state, without the
  (tokens, vocabulary) logits (``outputs.logits`` is None then, as with Liger-Kernel);
* ``moe``: the experts of an MoE block (transformers' fused experts: Mixtral's, Qwen3-MoE's,
  OLMoE's), found by running them (``_recognize_experts``) to compute each token's weighted sum of
  ``down_proj[e] @ (act(gate) * up)``: the permutation, the grouped products, the gated
  activation and the combine on the family's kernels (``cukern.moe``); the router stays the
  model's own; GPT-OSS's biased experts with their clamped gate and transposed, interleaved
  weights too (``cukern.torch.moe_experts_biased``).

Each routed call counts in ``cukern.torch.counts()``; calls the kernels do not take run the
model's own code. ``unpatch(model)`` (or leaving the ``with`` block) restores the model.
"""
from __future__ import annotations

import functools
import inspect
import sys
import threading
import types
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from . import _recognize, _recognize_experts, _tools
from ._api import api
from ._functional import DROPINS
from ._ops import OPS
from ._transformers_attention import register as _register_attention

PARTS = ("norm", "embedding", "mlp", "rope", "attention", "loss", "moe")

_lock = threading.Lock()
_patched: "weakref.WeakKeyDictionary[nn.Module, _Record]" = weakref.WeakKeyDictionary()
_rope_swaps: dict[str, list] = {}    # modeling module -> [its own function, models using ours, the decision]


class _Record:
    """What ``patch(model)`` changed on one model, to undo it."""

    def __init__(self):
        self.depth = 1
        self.modules: list[nn.Module] = []      # modules given an instance forward
        self.rope_modules: list[str] = []
        self.rope_looked: set[str] = set()     # modeling modules whose rope was checked
        self.attn_previous = None               # the attention implementation before
        self.decisions: dict[str, str] = {}     # module name -> what was routed, or why not


_API: dict = {}    # api() copied into a plain dict: torch.compile traces a lookup in it, while
                   # through api()'s cache it would trace the registry's imports and break the graph


def _api(name: str):
    fn = _API.get(name)
    if fn is None:
        _API.update(api())
        fn = _API[name]
    return fn


# ---- the module forwards ------------------------------------------------------------------------

def _layer_norm(self, input):
    return DROPINS["layer_norm"](input, self.normalized_shape, self.weight, self.bias, self.eps)


def _rms_norm(self, input):
    return DROPINS["rms_norm"](input, self.normalized_shape, self.weight, self.eps)


def _embedding(self, input):
    return DROPINS["embedding"](input, self.weight, self.padding_idx, self.max_norm, self.norm_type,
                                self.scale_grad_by_freq, self.sparse)


def _scaled_embedding(scale: float):
    """The forward of an embedding found to output the lookup times ``scale`` (Gemma's), the
    scale rounded to the weight's dtype as the model's own code rounds it."""
    if scale == 1.0:
        return _embedding

    def forward(self, input):
        return _embedding(self, input) * torch.tensor(scale, dtype=self.weight.dtype, device=self.weight.device)
    return forward


def _recognized_norm(variant: "_recognize.NormVariant"):
    """The forward of a module found to compute ``variant``: that norm in one kernel where the
    parameters have the input's dtype and device (the result's dtype is then the same); the
    module's own code otherwise and inside torch.compile (Inductor fuses it with the residual
    adds)."""
    name = "rms_norm" if variant.kind == "rms" else "layer_norm"

    def forward(self, hidden_states):
        own = type(self).forward
        if _tools.compiling():
            return own(self, hidden_states)
        x = hidden_states
        w = self.weight if variant.weight else None
        b = self.bias if variant.bias else None
        reason = _tools.float_params(x, w, b)
        mixed = reason is not None and _mixed(variant, x, w, b)
        if mixed:
            reason = None
        if reason is None and _tools.small(name, x.numel()):
            reason = _tools.SMALL
        _tools.count(name, reason)
        if reason is not None:
            return own(self, x)
        if mixed:
            return _mixed_norm(variant, x, w, b)
        if variant.kind == "rms":
            return OPS["rms_norm"](x, w, variant.eps, variant.offset, variant.casting)
        return OPS["layer_norm"](x, w, b, variant.eps, variant.offset)
    return forward


def _mixed(variant: "_recognize.NormVariant", x, w, b) -> bool:
    """Whether a call is a 16-bit CUDA input with float32 parameters on its device, in a module
    found to take such inputs in one of ``_recognize.MIXED_FORMS``."""
    return (variant.mixed is not None and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and all(p is None or (p.dtype == torch.float32 and p.device == x.device) for p in (w, b)))


def _mixed_norm(variant: "_recognize.NormVariant", x, w, b):
    """A 16-bit x with float32 parameters, as the module computes it (``variant.mixed``): "llama"
    as the kernel's x̂ rounded to x's dtype (no weight) times the float32 weight; "gemma" as the
    float32 kernel on x in float32, rounded once; "float" as that kernel, kept in float32. The
    float32 weight's gradient stays float32."""
    if variant.mixed == "llama":   # (RMSNorm's alone: _recognize finds no LayerNorm so)
        xhat = OPS["rms_norm"](x, None, variant.eps, 0.0, _recognize.CASTING_MODES["llama"])
        return xhat * (w + variant.offset if variant.offset else w)
    xf = x.float()
    if variant.kind == "rms":
        y = OPS["rms_norm"](xf, w, variant.eps, variant.offset, variant.casting)
    else:
        y = OPS["layer_norm"](xf, w, b, variant.eps, variant.offset)
    return y if variant.mixed == "float" else y.to(x.dtype)


def _tanh_gelu(self, input):
    if not _tools.compiling():
        _tools.count("gelu", None if input.is_cuda else "not a CUDA tensor")
    return F.gelu(input, approximate="tanh")


def _recognized_mlp(spec: "_recognize.GatedMLP"):
    """The forward of a module found to compute ``spec``: ``down(act(gate(x)) * up(x))`` with the
    activation and product in one kernel (the fused projection's halves read in place)."""
    name, kw, _ = _recognize.GATED_ACTS[spec.act]

    def forward(self, x):
        gate, up = spec.halves(self, x)
        return getattr(self, spec.down)(_api(name)(gate, up, **kw))
    return forward


# ---- mixture-of-experts: the experts ------------------------------------------------------------

def _experts_fallback(self, x, biased: bool = False) -> str | None:
    """Why a call of routed experts runs their own code, or None (``biased``: GPT-OSS's form,
    weights (E, in, out), biases of float32 or the weights' dtype)."""
    if not x.is_cuda:
        return "not on a CUDA device"
    autocast = torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") in (torch.float16,
                                                                                          torch.bfloat16)
    if x.ndim != 2 or not (x.dtype in (torch.float16, torch.bfloat16) or (x.dtype == torch.float32 and autocast)):
        return f"input {tuple(x.shape)} {x.dtype}, not (tokens, hidden) float16 or bfloat16 (or float32 under autocast)"
    if getattr(self, "_is_expert_parallel", False):
        return "expert parallel"
    for p in (self.gate_up_proj, self.down_proj):
        if p.device != x.device or (p.dtype != x.dtype and not (p.dtype == torch.float32 and autocast)):
            return "parameter dtype or device differs from the input's"
    if biased:
        for p in (self.gate_up_proj_bias, self.down_proj_bias):
            if p.device != x.device or p.dtype not in (torch.float32, self.gate_up_proj.dtype):
                return "bias dtype or device differs from the weights'"
    hidden, two_i = self.gate_up_proj.shape[1:] if biased else self.gate_up_proj.shape[2:0:-1]
    if hidden % 8 or two_i % 16:
        return "hidden or intermediate size not a multiple of 8"
    if self.gate_up_proj.shape[0] > 1024:
        return "more than 1024 experts"
    return None


def _recognized_experts(spec: "_recognize_experts.Experts"):
    """The forward of fused experts found to compute ``spec``: permutation, grouped products,
    the gated activation and the weighted combine on the kernels (the router stays the model's).
    Under autocast the input and the float32 weights are cast to autocast's dtype, as its
    F.linear casts them, and the result is returned in the input's dtype, as the model's own
    code returns it. Inside torch.compile the custom op ``torch.ops.cukern.moe_experts``."""
    def forward(self, hidden_states, top_k_index, top_k_weights):
        why = _experts_fallback(self, hidden_states)
        if not _tools.compiling():
            _tools.count("moe", why)
        if why is not None:
            return type(self).forward(self, hidden_states, top_k_index, top_k_weights)
        dt = hidden_states.dtype if hidden_states.dtype != torch.float32 else torch.get_autocast_dtype("cuda")
        out = _api("moe_experts")(hidden_states.to(dt), top_k_index, top_k_weights, self.gate_up_proj.to(dt),
                                  self.down_proj.to(dt), spec.act)
        return out.to(hidden_states.dtype)
    return forward


def _recognized_biased_experts(spec: "_recognize_experts.BiasedExperts"):
    """The forward of biased experts with the clamped gate (GPT-OSS's) found to compute
    ``spec``: ``cukern.torch.moe_experts_biased``, cast as ``_recognized_experts`` casts (the
    biases as they are: the op adds them in float32, as autocast adds a float32 bias)."""
    def forward(self, hidden_states, router_indices=None, routing_weights=None):
        why = _experts_fallback(self, hidden_states, biased=True)
        if not _tools.compiling():
            _tools.count("moe", why)
        if why is not None:
            return type(self).forward(self, hidden_states, router_indices, routing_weights)
        dt = hidden_states.dtype if hidden_states.dtype != torch.float32 else torch.get_autocast_dtype("cuda")
        out = _api("moe_experts_biased")(hidden_states.to(dt), router_indices, routing_weights,
                                         self.gate_up_proj.to(dt), self.gate_up_proj_bias, self.down_proj.to(dt),
                                         self.down_proj_bias, spec.alpha, spec.limit)
        return out.to(hidden_states.dtype)
    return forward


def _describe_experts(spec) -> str:
    if isinstance(spec, _recognize_experts.BiasedExperts):
        return (f"grouped experts with biases, clamped swiglu (alpha {spec.alpha:g}, limit {spec.limit:g}; gate and "
                "up interleaved)")
    return f"grouped experts, {_recognize.GATED_ACTS[spec.act][0]} (gate rows first)"


def _experts_forward(spec):
    return (_recognized_biased_experts if isinstance(spec, _recognize_experts.BiasedExperts)
            else _recognized_experts)(spec)


# ---- the loss: the LM head and cross-entropy without logits ------------------------------------

@functools.lru_cache(maxsize=None)
def _signature(cls):
    return inspect.signature(cls.forward)


def _causal_lm_loss(spec: "_recognize.LMHead"):
    def forward(self, *args, **kwargs):
        return _hf_causal_lm(self, *args, _lm=spec, **kwargs)
    return forward


def _describe_lm_head(spec: "_recognize.LMHead") -> str:
    return ("linear cross-entropy on the LM head" + (f", logits times {spec.scale:g}" if spec.scale != 1 else "")
            + (f", softcap {spec.softcap:g}" if spec.softcap is not None else ""))


def _hf_causal_lm(self, *args, _lm=None, **kwargs):
    """The model's forward, except in training with labels: the base model's last hidden
    state goes to ``linear_cross_entropy`` with the LM head's weight (labels shifted as
    transformers' ForCausalLMLoss shifts them, ``num_items_in_batch``, ``ignore_index`` and
    ``shift_labels`` honoured); ``logits`` is None."""
    own = type(self).forward
    if _tools.compiling():   # (measured slower there than Inductor's logits and loss: GPT-2 0.68x)
        return own(self, *args, **kwargs)
    bound = _signature(type(self)).bind(self, *args, **kwargs)
    a = dict(bound.arguments)
    labels = a.get("labels")
    if labels is None:
        return own(self, *args, **kwargs)
    extra = dict(a.pop("kwargs", {}))
    reason = None
    if not self.training:
        reason = "not training (logits wanted)"
    elif a.get("logits_to_keep", 0) not in (0, None):
        reason = "logits_to_keep"
    elif a.get("cache") is not None or extra.get("past_key_values") is not None:
        reason = "a cache"
    if reason is not None:
        _tools.count("linear_cross_entropy", reason)
        return own(self, *args, **kwargs)
    # (elsewhere than on a GPU, linear_cross_entropy runs PyTorch's ops)
    _tools.count("linear_cross_entropy", None if self.lm_head.weight.is_cuda else "not a CUDA tensor")
    for name in ("self", "labels", "logits_to_keep"):
        a.pop(name, None)
    num_items = extra.pop("num_items_in_batch", None)
    ignore_index = extra.pop("ignore_index", -100)
    shift_labels = extra.pop("shift_labels", None)
    return_dict = extra.pop("return_dict", None)
    base = getattr(self, self.base_model_prefix)
    outputs = base(**a, **extra, return_dict=True)
    hidden = outputs.last_hidden_state
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    head = self.lm_head
    spec = _lm or _recognize.LMHead()
    bias = head.bias
    if spec.scale != 1:   # (scaled logits: the hidden state and the bias scaled, the logits never made)
        hidden, bias = hidden * spec.scale, None if bias is None else bias * spec.scale
    loss = _api("linear_cross_entropy")(hidden, head.weight, shift_labels.to(hidden.device), bias,
                                        ignore_index=ignore_index, softcap=spec.softcap,
                                        reduction="mean" if num_items is None else "sum")
    if num_items is not None:
        loss = loss / (num_items.to(loss.device) if torch.is_tensor(num_items) else num_items)
    out = _output_class(outputs)(loss=loss, logits=None,
                                 **{k: v for k, v in outputs.items() if k != "last_hidden_state"})
    return out.to_tuple() if return_dict is False else out


def _output_class(outputs):
    from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions, CausalLMOutputWithPast

    return CausalLMOutputWithCrossAttentions if "cross_attentions" in type(outputs).__dataclass_fields__ \
        else CausalLMOutputWithPast


# ---- patching -------------------------------------------------------------------------------------

def _norm_shaped(m: nn.Module) -> bool:
    """Whether ``m`` looks like a norm enough to be run to find out: a leaf with a 1-D weight, or
    one with no parameters or buffers and an eps (a norm without a weight, nanochat's)."""
    w = getattr(m, "weight", None)
    if w is None:
        return _recognize.weightless_shaped(m)
    return isinstance(w, nn.Parameter) and w.dim() == 1 and next(m.children(), None) is None


def _describe(v: "_recognize.NormVariant") -> str:
    from ..norm.configs import CASTING_MODES

    if not v.weight:
        return "LayerNorm without weight or bias" if v.kind == "layer" else \
            "RMSNorm without weight" + (", casting none" if v.casting == CASTING_MODES["none"] else "")
    if v.kind == "layer":
        return "LayerNorm" + ("" if v.bias else " without bias") + (f", weight + {v.offset:g}" if v.offset else "")
    cast = {i: n for n, i in CASTING_MODES.items()}[v.casting]
    return "RMSNorm" + (f", weight + {v.offset:g}" if v.offset else "") + f", casting {cast}"


def _describe_mlp(spec: "_recognize.GatedMLP") -> str:
    act = {"silu": "SwiGLU", "gelu": "GeGLU", "gelu_tanh": "GeGLU (tanh)"}[spec.act]
    if spec.fused:
        return f"{act}, {spec.gate} fused ({'gate' if spec.gate_first else 'up'} half first), {spec.down}"
    return f"{act}, {spec.gate} / {spec.up} / {spec.down}"


def decisions(model: nn.Module) -> dict[str, str]:
    """``cukern.torch.routing(model)``: what ``patch(model)`` decided for each module it looked
    at (module name -> "norm: RMSNorm, casting llama", or "left alone: <why>"); {} for a model
    that is not patched."""
    rec = _patched.get(model)
    return dict(rec.decisions) if rec is not None else {}


def _route_found(rec: _Record, path: str, m: nn.Module, part: str, found: tuple, forward_of, describe) -> None:
    """Route ``m`` by what ``_recognize`` found it to compute (``found``: (what, None) or (None,
    why not)), and record the decision under ``path``."""
    what, why = found
    if what is None:
        rec.decisions[path] = f"left alone: {why}"
        return
    _set_forward(rec, m, forward_of(what))
    rec.decisions[path] = f"{part}: {describe(what)}"


def _set_forward(rec: _Record, m: nn.Module, fn) -> None:
    m.forward = types.MethodType(fn, m)
    rec.modules.append(m)


def _rope_wrapper(own, rounds: bool = False, partial: bool = False, half: bool = False, interleave: str = "",
                  negate: bool = False):
    """cukern's rope in place of ``own`` (a modeling module's ``apply_rotary_pos_emb``) for its
    callers: its arguments read by its own signature; anything else it takes goes to ``own``.
    ``rounds``: ``own`` rounds its result to q's dtype (OLMo 2's), so the result is rounded so
    too. ``partial``: ``own`` was found to rotate the first dims where its tables are narrower
    than the head (GPT-NeoX's ``rotary_pct``): the kernel rotates those in place of its chain of
    ops, and the rest is passed on as ``own`` passes it; without it such tables go to ``own``.
    ``half``: ``own`` takes tables of half the head's width, one angle a pair of dims (j, j + D/2)
    (GPT-OSS's): they are repeated to the kernel's full width. ``interleave``: ``own`` rotates
    pairs (2i, 2i + 1): "paired", with the tables it is given (Cohere's, whose rotary embedding
    repeats each angle in place); "split", after making them so from Hugging Face's half-split
    tables (their first half, each angle repeated in place: GLM's, Ernie 4.5's, Helium's).
    ``negate``: ``own`` rotates the other way (nanochat's), cukern's rope with sin negated (exact)."""
    ours = _api("apply_rotary_pos_emb")
    sig = inspect.signature(own)

    @functools.wraps(own)
    def apply_rotary_pos_emb(*args, **kwargs):
        try:
            a = sig.bind(*args, **kwargs).arguments
        except TypeError:
            return own(*args, **kwargs)
        q, k, cos, sin = (a.get(n) for n in ("q", "k", "cos", "sin"))
        extra = set(a) - {"q", "k", "cos", "sin", "position_ids", "unsqueeze_dim"}
        if extra or not all(torch.is_tensor(t) for t in (q, k, cos, sin)):
            return own(*args, **kwargs)
        d, r = q.shape[-1], cos.shape[-1]
        if half:
            if 2 * r != d or sin.shape[-1] != r:
                return own(*args, **kwargs)
            cos, sin, r = torch.cat([cos, cos], -1), torch.cat([sin, sin], -1), d
        elif r != d and not (partial and r < d and r % 2 == 0 and k.shape[-1] == d):
            return own(*args, **kwargs)
        if interleave == "split":
            if r % 2 or sin.shape[-1] != r:
                return own(*args, **kwargs)
            cos, sin = (t[..., : r // 2].repeat_interleave(2, dim=-1) for t in (cos, sin))
        if negate:
            sin = -sin
        dim, il = a.get("unsqueeze_dim", 1), bool(interleave)
        if r == d:
            oq, ok = ours(q, k, cos, sin, unsqueeze_dim=dim, interleaved=il)
        else:
            oq, ok = ours(q[..., :r], k[..., :r], cos, sin, unsqueeze_dim=dim, interleaved=il)
            oq, ok = torch.cat([oq, q[..., r:].to(oq.dtype)], -1), torch.cat([ok, k[..., r:].to(ok.dtype)], -1)
        if rounds:
            oq, ok = oq.to(q.dtype), ok.to(k.dtype)
        return oq, ok
    apply_rotary_pos_emb.cukern_own = own
    return apply_rotary_pos_emb


def _rope_one_wrapper(own, form: "_recognize.OneTensorRope"):
    """cukern's rope in place of ``own``, a modeling module's ``apply_rotary_pos_emb`` of one
    tensor a call found to compute ``form`` (GPT-J's and CodeGen's ``(tensor, sin, cos)``): the
    tables made the kernel's (half-width ones repeated to x's width as the rotation pairs its
    dims), and the kernel, which rotates a q and a k, given x as q and one head of it as k
    (detached: that result is dropped). Calls of another shape go to ``own``."""
    ours = _api("apply_rotary_pos_emb")
    sig = inspect.signature(own)

    @functools.wraps(own)
    def apply_rotary_pos_emb(*args, **kwargs):
        try:
            values = list(sig.bind(*args, **kwargs).arguments.values())
        except TypeError:
            return own(*args, **kwargs)
        if len(values) != 3 or not all(torch.is_tensor(t) for t in values):
            return own(*args, **kwargs)
        x, a, b = values
        tables = _one_tensor_tables(form, x, *((b, a) if form.sin_first else (a, b)))
        if tables is None:
            return own(*args, **kwargs)
        dim = 2 if form.seq_first else 1
        k = (x[:, :, :1] if form.seq_first else x[:, :1]).detach()
        out, _ = ours(x, k, *tables, unsqueeze_dim=dim, interleaved=form.interleaved)
        return out.to(x.dtype) if form.rounds else out
    apply_rotary_pos_emb.cukern_own = own
    return apply_rotary_pos_emb


def _one_tensor_tables(form: "_recognize.OneTensorRope", x, cos, sin):
    """(cos, sin) at x's width as the kernel reads them, or None where x (4-D, laid out as
    ``form`` says) and the (B, S, ·) tables are not of one call of ``form``."""
    if x.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape or x.shape[-1] % 2:
        return None
    if x.shape[1 if form.seq_first else 2] != cos.shape[1]:   # (the sequence's axis)
        return None
    d, r = x.shape[-1], cos.shape[-1]
    if r != (d // 2 if form.half else d):
        return None
    if form.half:
        cos, sin = ((t.repeat_interleave(2, dim=-1) if form.interleaved else torch.cat([t, t], -1)) for t in (cos, sin))
    return cos, sin


def _swap_rope(rec: _Record, modname: str, m: nn.Module) -> None:
    """Swap modeling module ``modname``'s ``apply_rotary_pos_emb`` for cukern's where it computes
    the same (``_rope_for``, on ``m``'s parameters' device and dtype)."""
    mod = sys.modules.get(modname)
    fn = getattr(mod, "apply_rotary_pos_emb", None) if mod is not None else None
    if not callable(fn):
        return
    entry = _rope_swaps.get(modname)
    if entry is None:
        p = next(m.parameters(), None)
        device, dtype = (p.device, p.dtype) if p is not None and p.dtype.is_floating_point else ("cpu", torch.float32)
        wrapper, verdict = _rope_for(modname, fn, device, dtype)
        rec.decisions[f"{modname}.apply_rotary_pos_emb"] = verdict
        if wrapper is None:
            return
        entry = _rope_swaps[modname] = [fn, 0, verdict]
        mod.apply_rotary_pos_emb = wrapper
    else:
        rec.decisions[f"{modname}.apply_rotary_pos_emb"] = entry[2]
    entry[1] += 1
    rec.rope_modules.append(modname)


def _rope_for(modname: str, fn, device, dtype):
    """(cukern's rope in place of ``fn``, the decision) or (None, "left alone: why"): ``fn`` run
    as a rope of q and k (``_recognize.recognize_rope``), and where it is not one, as a rope of
    one tensor a call (``_recognize.recognize_rope_one``: GPT-J's, CodeGen's). The reason given
    is the one of the form ``fn`` took."""
    why, rounds, partial, half, interleave, negate = _recognize.recognize_rope(
        modname, fn, functools.partial(_rope_wrapper, fn), device, dtype)
    if why is None:
        return _rope_wrapper(fn, rounds, partial, half, interleave, negate), (
            "rope: cukern's rope" + (", interleaved pairs" if interleave else "")
            + (", rotated the other way (sin negated)" if negate else ""))
    form, why_one = _recognize.recognize_rope_one(modname, fn, functools.partial(_rope_one_wrapper, fn), device,
                                                  dtype)
    if form is not None:
        return _rope_one_wrapper(fn, form), (
            "rope: cukern's rope" + (", interleaved pairs" if form.interleaved else "")
            + f", one tensor a call (x, {'sin, cos' if form.sin_first else 'cos, sin'})"
            + (", half-width tables" if form.half else ""))
    return None, f"left alone: {why_one if why.startswith(_recognize.QK_REFUSED) else why}"


def parts_of(parts) -> tuple[str, ...]:
    names = PARTS if parts is None else tuple(parts)
    unknown = sorted(set(names) - set(PARTS))
    if unknown:
        raise ValueError(f"parts: unknown {unknown}; choose from {list(PARTS)}")
    return names


def patch_model(model: nn.Module, parts=None) -> None:
    """Route ``model``'s modules (see the module's docstring); ``parts`` chooses which of
    ``PARTS`` (default all). A model patched twice needs two ``unpatch_model``."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    names = parts_of(parts)
    if not _API:
        _API.update(api())
    with _lock:
        rec = _patched.get(model)
        if rec is not None:
            rec.depth += 1
            return
        rec = _Record()
        for path, m in model.named_modules():
            if "forward" in m.__dict__ or m in rec.modules:
                continue   # (a forward of its own: someone else's patch; leave it)
            if "norm" in names and isinstance(m, nn.LayerNorm):
                _set_forward(rec, m, _layer_norm)
                rec.decisions[path] = "norm: nn.LayerNorm"
            elif "norm" in names and isinstance(m, nn.RMSNorm):
                _set_forward(rec, m, _rms_norm)
                rec.decisions[path] = "norm: nn.RMSNorm"
            elif "norm" in names and _norm_shaped(m):
                _route_found(rec, path, m, "norm", _recognize.recognize_norm(m), _recognized_norm, _describe)
            elif "embedding" in names and isinstance(m, nn.Embedding):
                _route_found(rec, path, m, "embedding", _recognize.recognize_embedding(m), _scaled_embedding,
                             lambda scale: "nn.Embedding" + ("" if scale == 1.0 else f", times {scale:g}"))
            elif "moe" in names and _recognize_experts.experts_shaped(m):
                _route_found(rec, path, m, "moe", _recognize_experts.recognize_experts(m), _experts_forward,
                             _describe_experts)
            elif "mlp" in names and _recognize._mlp_candidates(m):
                _route_found(rec, path, m, "mlp", _recognize.recognize_mlp(m), _recognized_mlp, _describe_mlp)
            elif "mlp" in names and _recognize.recognize_tanh_gelu(m):
                _set_forward(rec, m, _tanh_gelu)
                rec.decisions[path] = "mlp: tanh GELU (PyTorch's fused)"
            elif "loss" in names and isinstance(getattr(m, "lm_head", None), nn.Linear):
                _route_found(rec, path or "(model)", m, "loss", _recognize.recognize_lm_head(m), _causal_lm_loss,
                             _describe_lm_head)
            modname = type(m).__module__
            if ("rope" in names and modname not in rec.rope_modules and modname not in rec.rope_looked
                    and callable(getattr(sys.modules.get(modname), "apply_rotary_pos_emb", None))):
                rec.rope_looked.add(modname)
                _swap_rope(rec, modname, m)
        if "attention" in names and callable(getattr(model, "set_attn_implementation", None)):
            _register_attention()
            rec.attn_previous = model.config._attn_implementation
            model.set_attn_implementation("cukern")
        _patched[model] = rec


def unpatch_model(model: nn.Module) -> None:
    """Undo one ``patch_model(model)``; the last restores the model's own code."""
    with _lock:
        rec = _patched.get(model)
        if rec is None:
            return
        rec.depth -= 1
        if rec.depth > 0:
            return
        for m in rec.modules:
            m.__dict__.pop("forward", None)
        for modname in rec.rope_modules:
            entry = _rope_swaps[modname]
            entry[1] -= 1
            if entry[1] == 0:
                sys.modules[modname].apply_rotary_pos_emb = entry[0]
                del _rope_swaps[modname]
        if rec.attn_previous is not None:
            model.set_attn_implementation(rec.attn_previous)
        del _patched[model]


def is_model_patched(model: nn.Module) -> bool:
    return model in _patched


def any_patched_but(model) -> bool:
    """Whether a model other than ``model`` is patched (min_size is shared by all)."""
    return any(m is not model for m in list(_patched.keys()))
