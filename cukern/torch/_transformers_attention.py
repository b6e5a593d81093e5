"""transformers' attention implementation "cukern" and its mask function, which
``patch(model)`` registers with ``AttentionInterface`` and ``AttentionMaskInterface`` and sets on
a patched model: causal masks run causal, padding masks and packed documents as varlen, a
sliding window (read from a windowed layer's mask) as a window, a softcap and GPT-OSS's sinks
with the kernels that take them; everything else goes to PyTorch's SDPA (or the model's eager
code where SDPA cannot compute it), counted."""
from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F

from . import _tools
from ._ops import OPS


def _hf_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
             local_size=None, allow_is_causal_skip=True, config=None, **kwargs):
    """transformers' mask function for "cukern": None for a causal mask, the (B, S) bool
    padding mask for a causal mask with key padding, and SDPA's mask (4D) for anything else,
    marked with its documents where it is found to be causal within packed documents (and
    within a sliding window: a windowed layer's mask is read, not assumed)."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    # (a window that hides a key: SDPA's mask below, which is read for its window; None or the
    # padding alone would leave the window to the attention module passing it)
    window_known = local_size is None or kv_length < local_size
    plain = (allow_is_causal_skip and isinstance(q_offset, int) and q_offset == 0 and kv_offset == 0
             and q_length == kv_length and window_known
             and (mask_function is causal_mask_function or local_size is not None))
    if plain and attention_mask is None:
        return None
    if plain and attention_mask.dim() == 2 and attention_mask.shape[-1] == kv_length and not _tools.compiling():
        pad = attention_mask.to(torch.bool)
        return None if bool(pad.all()) else pad
    dense = sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                      kv_offset=kv_offset, mask_function=mask_function, attention_mask=attention_mask,
                      local_size=local_size, allow_is_causal_skip=allow_is_causal_skip, config=config, **kwargs)
    if (torch.is_tensor(dense) and dense.dim() == 4 and dense.dtype == torch.bool and dense.shape[1] == 1
            and q_length == kv_length and isinstance(q_offset, int) and q_offset == 0 and kv_offset == 0
            and not _tools.compiling()):
        # packed documents (position ids that restart), or a sliding window (one document a row):
        # SDPA's mask goes on to the attention, which runs them as varlen with the window the
        # mask was found to hold; the documents ride on the mask, so that anything else that
        # gets it (a copy, a fallback) still has SDPA's mask
        docs = _documents(dense.expand(batch_size, -1, -1, -1), local_size)
        if docs is not None:
            dense._cukern_documents = docs
    return dense


def _documents(mask, window):
    """(cu_seqlens (documents + 1,) int32 over the (B * S) tokens, the longest document,
    window) where the (B, 1, S, S) bool mask is causal attention within consecutive documents
    (and, with ``window``, to the last ``window`` keys: HF's sliding window), else None."""
    m = mask[:, 0]
    b, s = m.shape[0], m.shape[-1]
    i = torch.arange(s, device=m.device)
    new = torch.ones((b, s), dtype=torch.bool, device=m.device)
    new[:, 1:] = ~m[:, i[1:], i[:-1]]   # a token starts a document when it may not see the one before
    start = torch.where(new, i, 0).cummax(-1).values
    rows, cols = i[None, :, None], i[None, None, :]
    want = (cols <= rows) & (cols >= start[:, :, None])
    if window is not None:
        want = want & (cols > rows - window)
    if not torch.equal(m, want):
        return None
    cu = F.pad(new.reshape(-1).nonzero().squeeze(1).to(torch.int32), (0, 1), value=b * s)
    return cu, int((cu[1:] - cu[:-1]).max()), window


def _dense_mask(pad, q_length, causal, window):
    """The (B, 1, Sq, Sk) bool mask of a key-padding mask (for PyTorch's SDPA)."""
    sk = pad.shape[-1]
    i = torch.arange(q_length, device=pad.device)[:, None] + (sk - q_length)
    j = torch.arange(sk, device=pad.device)[None, :]
    keep = (j <= i) if causal else torch.ones((q_length, sk), dtype=torch.bool, device=pad.device)
    if window is not None:
        keep = keep & (j > i - window)
    return keep[None, None] & pad[:, None, None, :]


@functools.cache
def _sdpa_route():
    """The route the attention family registered for SDPA's drop-in (through the registry: no
    family's private names here)."""
    from .._registry import families

    return next(d.route for f in families() for d in f.dropins if d.replaces == "scaled_dot_product_attention")


def _hf_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                  sliding_window=None, softcap=None, **kwargs):
    """transformers' attention interface for "cukern": q and k (B, H / Hkv, S, D), v (B, Hkv, Sk,
    Dv) in, (B, Sq, H, Dv) out (Dv: D, or MLA's 128 beside 192). Causal or not, key padding (as
    varlen), a sliding window, a softcap, GPT-OSS's sinks (``s_aux``) and dropout (where the SDPA
    drop-in takes it, without padding, documents, a softcap or sinks) on the kernels; other masks
    and decoding on PyTorch's SDPA, or on the model's own eager code where SDPA cannot
    compute them (a softcap, sinks)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True))
    sinks = kwargs.get("s_aux")   # (GPT-OSS's learnable sinks, one logit a query head)
    sq, sk = query.shape[2], key.shape[2]
    window = int(sliding_window) if sliding_window and causal and sk > sliding_window - 1 else None
    pad = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
    docs = getattr(attention_mask, "_cukern_documents", None)
    reason = None
    if _tools.compiling():
        reason = "compiling"   # (PyTorch's SDPA in compiled graphs, as the drop-in's choice)
    elif attention_mask is not None and pad is None and docs is None:
        reason = "a mask that is neither causal, key padding nor packed documents"
    elif docs is not None and not causal:
        reason = "packed documents without a causal mask"
    elif dropout and (pad is not None or docs is not None or softcap or sinks is not None):
        reason = "dropout with key padding, packed documents, a softcap or sinks"
    elif kwargs.get("output_attentions") or kwargs.get("position_bias") is not None:
        reason = "attention weights or a position bias"
    elif sq != sk:
        reason = "query and key lengths differ (decoding)"
    elif pad is not None and window is not None:
        reason = "key padding with a sliding window"
    elif sinks is not None and (not torch.is_tensor(sinks) or sinks.shape != (query.shape[1],)):
        reason = "sinks that are not one logit a query head"
    if reason is None:
        r = _sdpa_route()(_tools, query, key, value, dropout_p=dropout, is_causal=causal, scale=scaling,
                          enable_gqa=True)
        if isinstance(r, str):
            reason = r
    if reason != "compiling":
        _tools.count("attention", reason)
    if reason is not None:
        if softcap or sinks is not None or kwargs.get("output_attentions"):   # (what PyTorch's SDPA cannot:
            eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)  # its own)
            if eager is None and sinks is not None:   # (SDPA would drop the sinks: a wrong answer)
                raise RuntimeError(f"cukern attention: {reason}, and {type(module).__name__}'s module has no "
                                   "eager_attention_forward to run its sinks (s_aux) with")
            if eager is not None and (attention_mask is None or pad is not None or attention_mask.dim() == 4):
                if attention_mask is None or pad is not None:
                    keep = _dense_mask(pad if pad is not None else torch.ones((query.shape[0], sk), dtype=torch.bool,
                                                                              device=query.device), sq, causal, window)
                elif attention_mask.dtype == torch.bool:
                    keep = attention_mask
                else:
                    keep = None
                if keep is not None:   # (eager code adds its mask to the scores)
                    attention_mask = torch.zeros(keep.shape, dtype=query.dtype, device=query.device).masked_fill(
                        ~keep, torch.finfo(query.dtype).min)
                return eager(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                             softcap=softcap, **kwargs)
        if sinks is not None:   # (a mask the eager path above does not take: SDPA would drop the sinks)
            raise RuntimeError(f"cukern attention: {reason}, and {type(module).__name__}'s sinks (s_aux) cannot go "
                               "to PyTorch's SDPA with this mask")
        if pad is not None:
            attention_mask = _dense_mask(pad, sq, causal, window)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      is_causal=is_causal, softcap=softcap, **kwargs)
    name, args, _ = r   # (B, S, H, D) views, the mask flags and scale as the route read them
    wl = window - 1 if window is not None else -1
    if name == "attention_dropout":   # (the route's draw, args[3])
        return OPS[name](*args[:6], wl, -1, 0.0, *args[9:]), None
    q, k, v, c, s = args[:5]
    cap = float(softcap or 0.0)
    sk32 = None if sinks is None else sinks.float()
    if docs is not None:
        return _packed(q, k, v, docs, s, cap, sk32), None
    if pad is None:
        if sk32 is not None:
            return OPS["attention_sink"](q, k, v, sk32, c, s, wl, -1, cap, -1), None
        return OPS["attention"](q, k, v, c, s, wl, -1, cap, -1), None
    return _unpadded(q, k, v, pad, c, s, cap, sk32), None


def _varlen(q, k, v, cu, longest, causal, scale, wl, cap, sinks):
    """The varlen op over (tokens, heads, D), with the sinks (float32 (H,)) where given."""
    if sinks is not None:
        return OPS["attention_varlen_sink"](q, k, v, cu, cu, sinks, longest, longest, causal, scale, wl, -1, cap, -1)
    return OPS["attention_varlen"](q, k, v, cu, cu, longest, longest, causal, scale, wl, -1, cap, -1)


def _packed(q, k, v, docs, scale, cap, sinks=None):
    """Packed documents (causal within each) as varlen over the (B * S) tokens."""
    cu, longest, window = docs
    b, s, h, d = q.shape
    hk, dv = k.shape[2], v.shape[3]
    wl = window - 1 if window is not None and window < longest else -1
    out, _ = _varlen(q.reshape(b * s, h, d), k.reshape(b * s, hk, d), v.reshape(b * s, hk, dv), cu, longest, True,
                     scale, wl, cap, sinks)
    return out.view(b, s, h, dv)


def _unpadded(q, k, v, pad, causal, scale, cap, sinks=None):
    """Key padding as packed sequences: the kept tokens of each row are one sequence (a
    padding token is dropped from keys and queries alike), attention runs varlen, and the
    output is scattered back with zeros at the padding (as transformers' FlashAttention
    path gives)."""
    b, s, h, d = q.shape
    lens = pad.sum(1, dtype=torch.int32)
    idx = pad.reshape(-1).nonzero().squeeze(1)
    cu = F.pad(lens.cumsum(0, dtype=torch.int32), (1, 0))
    longest = int(lens.max())
    hk, dv = k.shape[2], v.shape[3]
    qu, ku, vu = q.reshape(b * s, h, d)[idx], k.reshape(b * s, hk, d)[idx], v.reshape(b * s, hk, dv)[idx]
    out, _ = _varlen(qu, ku, vu, cu, longest, causal, scale, -1, cap, sinks)
    return out.new_zeros((b * s, h, dv)).index_copy(0, idx, out).view(b, s, h, dv)


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register("cukern", _hf_attention)
    AttentionMaskInterface.register("cukern", _hf_mask)
