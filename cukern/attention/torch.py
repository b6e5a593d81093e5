"""Attention under ``cukern.torch``: the custom ops, their fake (meta) functions, the
functions the package exports and the SDPA drop-in's route."""
from __future__ import annotations

import dataclasses
import math

from .. import _arrays
from .._family import TorchOp
from .backward import attention_backward, attention_varlen_backward
from .checks import _dropout_p
from .configs import CONFIGS, HEAD_DIMS
from .forward import attention, attention_varlen

# ---- PyTorch bindings -------------------------------------------------------------------------

def _empty_like(t, shape=None):
    """An output laid out as the front lays out one like ``t`` (the same function decides), of
    ``t``'s shape or ``shape``."""
    import torch

    shape = tuple(t.shape) if shape is None else tuple(shape)
    return torch.empty_strided(shape, _arrays.like_strides(shape, t.stride()), dtype=t.dtype, device=t.device)


def _out_like(q, v):
    """The output: q's shape with v's head size, laid out like q."""
    return _empty_like(q, (*q.shape[:-1], v.shape[-1]))


def _fake(q, k, v, causal, scale, window_left, window_right, softcap, deterministic):
    import torch

    b, sq, h, _ = q.shape
    return _out_like(q, v), q.new_empty((b, h, sq), dtype=torch.float32)


def _bwd_fake(dout, q, k, v, out, lse, *args):
    return _empty_like(q), _empty_like(k), _empty_like(v)


def _varlen_fake(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, window_left, window_right, softcap, deterministic):
    import torch

    return _out_like(q, v), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _sink_fake(q, k, v, sinks, *args):
    return _fake(q, k, v, *args)


def _sink_bwd_fake(dout, q, k, v, sinks, out, lse, *args):
    return (*_bwd_fake(dout, q, k, v, out, lse), sinks.new_empty(sinks.shape))


def _varlen_sink_fake(q, k, v, cu_q, cu_k, sinks, *args):
    return _varlen_fake(q, k, v, cu_q, cu_k, *args)


def _varlen_sink_bwd_fake(dout, q, k, v, out, lse, cu_q, cu_k, sinks, *args):
    return (*_bwd_fake(dout, q, k, v, out, lse), sinks.new_empty(sinks.shape))


# (window and softcap as flash-attn passes them: two ints, -1 unbounded, and a float, 0 none;
# deterministic -1 follows torch.use_deterministic_algorithms, 0 or 1 is flash-attn's argument)
_MASK_SCHEMA = "int window_left, int window_right, float softcap"


def _det(state, T) -> bool:
    return T.deterministic() if state[-1] < 0 else bool(state[-1])

TORCH_OPS = (
    TorchOp("attention", f"(Tensor q, Tensor k, Tensor v, bool causal, float scale, {_MASK_SCHEMA}, "
                         "int deterministic) -> (Tensor, Tensor)",
            forward=lambda q, k, v, c, s, wl, wr, cap, _: attention(q, k, v, causal=c, softmax_scale=s,
                                                                    return_lse=True, window=(wl, wr), softcap=cap),
            inference=lambda q, k, v, c, s, wl, wr, cap, _: attention(q, k, v, causal=c, softmax_scale=s,
                                                                      window=(wl, wr), softcap=cap),
            fake=_fake,
            save=lambda inputs, outputs: ((*inputs[:3], *outputs), inputs[3:]),
            backward_schema="(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal, "
                            f"float scale, {_MASK_SCHEMA}, bool deterministic) -> (Tensor, Tensor, Tensor)",
            backward=lambda do, q, k, v, o, lse, c, s, wl, wr, cap, det: attention_backward(
                do, q, k, v, o, lse, causal=c, softmax_scale=s, deterministic=det, window=(wl, wr), softcap=cap),
            backward_fake=_bwd_fake,
            backward_args=lambda saved, state, grads, T: (grads[0], *saved, *state[:-1], _det(state, T)),
            grads_to=(0, 1, 2), native=True),
    TorchOp("attention_varlen", "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
                                f"int max_seqlen_q, int max_seqlen_k, bool causal, float scale, {_MASK_SCHEMA}, "
                                "int deterministic) -> (Tensor, Tensor)",
            forward=lambda q, k, v, cq, ck, mq, mk, c, s, wl, wr, cap, _: attention_varlen(
                q, k, v, cq, ck, mq, mk, causal=c, softmax_scale=s, return_lse=True, window=(wl, wr), softcap=cap),
            fake=_varlen_fake,
            # (saved: q, k, v, out, lse and the offsets; state: the lengths and the mask)
            save=lambda inputs, outputs: ((*inputs[:3], *outputs, *inputs[3:5]), inputs[5:]),
            backward_schema="(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor cu_seqlens_q, "
                            "Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, bool causal, float scale, "
                            f"{_MASK_SCHEMA}, bool deterministic) -> (Tensor, Tensor, Tensor)",
            backward=lambda do, q, k, v, o, lse, cq, ck, mq, mk, c, s, wl, wr, cap, det: attention_varlen_backward(
                do, q, k, v, o, lse, cq, ck, mq, mk, causal=c, softmax_scale=s, deterministic=det, window=(wl, wr),
                softcap=cap),
            backward_fake=_bwd_fake,
            backward_args=lambda saved, state, grads, T: (grads[0], *saved, *state[:-1], _det(state, T)),
            # (native: the plan depends on the arguments alone; the offsets are read on the device.
            # max_seqlen and the number of documents are in the signature, so a workload whose
            # documents change every batch records each new (count, longest) pair once)
            grads_to=(0, 1, 2), visible=2, native=True),
)
# With attention sinks (flash-attn's learnable_sink): ops of their own, the sinks (H,) float32 a
# differentiated input after k and v (after the offsets, packed), their gradient the fourth.
TORCH_OPS += (
    TorchOp("attention_sink", f"(Tensor q, Tensor k, Tensor v, Tensor sinks, bool causal, float scale, {_MASK_SCHEMA}, "
                              "int deterministic) -> (Tensor, Tensor)",
            forward=lambda q, k, v, sk, c, s, wl, wr, cap, _: attention(
                q, k, v, causal=c, softmax_scale=s, return_lse=True, window=(wl, wr), softcap=cap, sinks=sk),
            inference=lambda q, k, v, sk, c, s, wl, wr, cap, _: attention(
                q, k, v, causal=c, softmax_scale=s, window=(wl, wr), softcap=cap, sinks=sk),
            fake=_sink_fake,
            save=lambda inputs, outputs: ((*inputs[:4], *outputs), inputs[4:]),
            backward_schema="(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor sinks, Tensor out, Tensor lse, "
                            f"bool causal, float scale, {_MASK_SCHEMA}, bool deterministic) "
                            "-> (Tensor, Tensor, Tensor, Tensor)",
            backward=lambda do, q, k, v, sk, o, lse, c, s, wl, wr, cap, det: attention_backward(
                do, q, k, v, o, lse, causal=c, softmax_scale=s, deterministic=det, window=(wl, wr), softcap=cap,
                sinks=sk),
            backward_fake=_sink_bwd_fake,
            backward_args=lambda saved, state, grads, T: (grads[0], *saved, *state[:-1], _det(state, T)),
            grads_to=(0, 1, 2, 3), native=True),
    TorchOp("attention_varlen_sink", "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
                                     f"Tensor sinks, int max_seqlen_q, int max_seqlen_k, bool causal, float scale, "
                                     f"{_MASK_SCHEMA}, int deterministic) -> (Tensor, Tensor)",
            forward=lambda q, k, v, cq, ck, sk, mq, mk, c, s, wl, wr, cap, _: attention_varlen(
                q, k, v, cq, ck, mq, mk, causal=c, softmax_scale=s, return_lse=True, window=(wl, wr), softcap=cap,
                sinks=sk),
            fake=_varlen_sink_fake,
            # (saved: q, k, v, out, lse, the offsets and the sinks; state: the lengths and the mask)
            save=lambda inputs, outputs: ((*inputs[:3], *outputs, *inputs[3:6]), inputs[6:]),
            backward_schema="(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor cu_seqlens_q, "
                            "Tensor cu_seqlens_k, Tensor sinks, int max_seqlen_q, int max_seqlen_k, bool causal, "
                            f"float scale, {_MASK_SCHEMA}, bool deterministic) -> (Tensor, Tensor, Tensor, Tensor)",
            backward=lambda do, q, k, v, o, lse, cq, ck, sk, mq, mk, c, s, wl, wr, cap, det: attention_varlen_backward(
                do, q, k, v, o, lse, cq, ck, mq, mk, causal=c, softmax_scale=s, deterministic=det, window=(wl, wr),
                softcap=cap, sinks=sk),
            backward_fake=_varlen_sink_bwd_fake,
            backward_args=lambda saved, state, grads, T: (grads[0], *saved, *state[:-1], _det(state, T)),
            grads_to=(0, 1, 2, 5), visible=2, native=True),
)
# With dropout: the draw's (seed, offset), (2,) int64 on the device, an input after k and v that
# the backward takes again (the same weights dropped; a second backward too). dropout_p is state.
def _dropout_fake(q, k, v, rng, *args):
    return _fake(q, k, v, *args[:5], args[-1])


def _dropout_bwd_fake(dout, q, k, v, rng, out, lse, *args):
    return _bwd_fake(dout, q, k, v, out, lse)


def _varlen_dropout_fake(q, k, v, cu_q, cu_k, rng, max_q, max_k, causal, scale, wl, wr, cap, p, det):
    return _varlen_fake(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, wl, wr, cap, det)


TORCH_OPS += (
    TorchOp("attention_dropout", "(Tensor q, Tensor k, Tensor v, Tensor rng, bool causal, float scale, "
                                 f"{_MASK_SCHEMA}, float dropout_p, int deterministic) -> (Tensor, Tensor)",
            forward=lambda q, k, v, rng, c, s, wl, wr, cap, p, _: attention(
                q, k, v, causal=c, softmax_scale=s, return_lse=True, window=(wl, wr), softcap=cap, dropout_p=p,
                dropout_rng=rng),
            inference=lambda q, k, v, rng, c, s, wl, wr, cap, p, _: attention(
                q, k, v, causal=c, softmax_scale=s, window=(wl, wr), softcap=cap, dropout_p=p, dropout_rng=rng),
            fake=_dropout_fake,
            save=lambda inputs, outputs: ((*inputs[:4], *outputs), inputs[4:]),
            backward_schema="(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor rng, Tensor out, Tensor lse, "
                            f"bool causal, float scale, {_MASK_SCHEMA}, float dropout_p, bool deterministic) "
                            "-> (Tensor, Tensor, Tensor)",
            backward=lambda do, q, k, v, rng, o, lse, c, s, wl, wr, cap, p, det: attention_backward(
                do, q, k, v, o, lse, causal=c, softmax_scale=s, deterministic=det, window=(wl, wr), softcap=cap,
                dropout_p=p, dropout_rng=rng),
            backward_fake=_dropout_bwd_fake,
            backward_args=lambda saved, state, grads, T: (grads[0], *saved, *state[:-1], _det(state, T)),
            grads_to=(0, 1, 2), native=True),
    # (packed documents: the draw after the offsets; each token drawn at its place in the pack)
    TorchOp("attention_varlen_dropout", "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
                                        "Tensor rng, int max_seqlen_q, int max_seqlen_k, bool causal, float scale, "
                                        f"{_MASK_SCHEMA}, float dropout_p, int deterministic) -> (Tensor, Tensor)",
            forward=lambda q, k, v, cq, ck, rng, mq, mk, c, s, wl, wr, cap, p, _: attention_varlen(
                q, k, v, cq, ck, mq, mk, causal=c, softmax_scale=s, return_lse=True, window=(wl, wr), softcap=cap,
                dropout_p=p, dropout_rng=rng),
            fake=_varlen_dropout_fake,
            # (saved: q, k, v, out, lse, the offsets and the draw; state: the lengths, the mask, p)
            save=lambda inputs, outputs: ((*inputs[:3], *outputs, *inputs[3:6]), inputs[6:]),
            backward_schema="(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor cu_seqlens_q, "
                            "Tensor cu_seqlens_k, Tensor rng, int max_seqlen_q, int max_seqlen_k, bool causal, "
                            f"float scale, {_MASK_SCHEMA}, float dropout_p, bool deterministic) "
                            "-> (Tensor, Tensor, Tensor)",
            backward=lambda do, q, k, v, o, lse, cq, ck, rng, mq, mk, c, s, wl, wr, cap, p, det:
                attention_varlen_backward(do, q, k, v, o, lse, cq, ck, mq, mk, causal=c, softmax_scale=s,
                                          deterministic=det, window=(wl, wr), softcap=cap, dropout_p=p,
                                          dropout_rng=rng),
            backward_fake=_bwd_fake,
            backward_args=lambda saved, state, grads, T: (grads[0], *saved, *state[:-1], _det(state, T)),
            grads_to=(0, 1, 2), visible=2, native=True),
)


def dropout_draw(device):
    """(2,) int64 on ``device``: the seed and Philox offset of one dropout call, two random
    words drawn on the device from PyTorch's CUDA generator (``torch.randint``): so
    ``torch.manual_seed`` repeats a run, two calls draw apart, and a captured CUDA graph or a
    compiled graph draws anew each time it runs, as PyTorch's own dropout does. Nothing is read
    on the host."""
    import torch

    return torch.randint(-(1 << 63), (1 << 63) - 1, (2,), dtype=torch.int64, device=device)


def dropout_route_reason(device, d: int, dv: int) -> str | None:
    """Why the drop-ins leave a call with dropout to PyTorch on ``device`` (a CUDA
    torch.device), or None: they take it where the Hopper kernels draw it (head dims 64 and
    128, q's and v's the same), measured faster than PyTorch's SDPA with dropout there; the
    sm_80 kernels that take it elsewhere measured slower (docs/notes-attention.md)."""
    if not (CONFIGS.use_sm90_dropout and CONFIGS.use_sm90 and CONFIGS.use_sm90_bwd and _hopper(device)):
        return "dropout off Hopper"
    if dv != d or d not in dict(CONFIGS.bwd_sm90_dropout):
        return f"dropout at head_dim {d}"
    return None


# flash_attn_func(return_attn_probs=True): the same ops with the lse visible (not differentiated)
TORCH_OPS += (dataclasses.replace(TORCH_OPS[0], name="attention_lse", visible=2, inference=None, native=False),
              dataclasses.replace(TORCH_OPS[2], name="attention_sink_lse", visible=2, inference=None, native=False))


def _torch_api(T, ops, modules) -> dict:
    """``cukern.torch.flash_attn_func`` and ``flash_attn_varlen_func``: flash-attn's functions
    (its signatures, (batch, seqlen, heads, head_dim) and packed (tokens, heads, head_dim)
    layouts, the lse it returns with ``return_attn_probs``), so that a flash-attn user switches
    by changing one import. Autograd and torch.compile through the custom ops."""
    dense, with_lse, packed = ops["attention"], ops["attention_lse"], ops["attention_varlen"]
    dropping, packed_dropping = ops["attention_dropout"], ops["attention_varlen_dropout"]
    sink, sink_with_lse, packed_sink = ops["attention_sink"], ops["attention_sink_lse"], ops["attention_varlen_sink"]

    def _call(op, *args):
        return op.compiled(*args) if T.compiling() else op(*args)

    def _sinks(learnable_sink):
        # (float32 for the kernels; a bfloat16 parameter, as FlashAttention-4 takes, gets its
        # gradient back through the cast)
        if learnable_sink is None or not hasattr(learnable_sink, "dtype"):
            return learnable_sink
        import torch

        return learnable_sink.to(torch.float32)

    def _unsupported(alibi_slopes, block_table=None):
        if alibi_slopes is not None:
            raise ValueError("alibi_slopes: cukern's attention has no ALiBi bias")
        if block_table is not None:
            raise ValueError("block_table: cukern's attention has no paged KV cache")

    def _draw(q, dropout_p, softcap, learnable_sink, return_attn_probs):
        """A call with dropout checked, then its draw ((2,) int64 on q's device)."""
        _dropout_p(dropout_p, softcap)
        if learnable_sink is not None or return_attn_probs:
            raise ValueError(f"dropout_p: {dropout_p} with learnable_sink or return_attn_probs: not taken")
        if not getattr(q, "is_cuda", False):
            _arrays.as_device_array(q, "q")   # (raises: the draw needs a CUDA device)
        return dropout_draw(q.device)

    def _flags(q, softmax_scale, window_size, softcap):
        if not hasattr(q, "shape"):   # (the default scale reads q before the op checks it)
            _arrays.as_device_array(q, "q")
        wl, wr = window_size if window_size is not None else (-1, -1)
        s = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
        return s, int(wl), int(wr), float(softcap or 0.0)

    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
                        alibi_slopes=None, deterministic=False, return_attn_probs=False, learnable_sink=None):
        """flash-attn's ``flash_attn_func``: q (B, Sq, H, D), k (B, Sk, Hkv, D) and v (B, Sk, Hkv,
        Dv), float16 or bfloat16 (Dv = D, or MLA's 128 beside D = 192); the out (B, Sq, H, Dv);
        with ``return_attn_probs`` (out, lse (B, H, Sq), None).
        ``deterministic``: dq summed in a fixed order (as attention_backward's).
        ``learnable_sink``: (H,) attention sinks, FlashAttention-4's name (``cukern.attention``'s
        ``sinks``), float32 or a dtype cast to it; differentiated. ``dropout_p``: drops attention
        weights by a Philox draw seeded from PyTorch's CUDA generator (``torch.manual_seed``
        repeats it; a CUDA graph's replay or a compiled graph draws anew each run; not with sinks,
        the softcap or ``return_attn_probs``)."""
        _unsupported(alibi_slopes)
        s, wl, wr, cap = _flags(q, softmax_scale, window_size, softcap)
        flags = (bool(causal), s, wl, wr, cap, int(bool(deterministic)))
        if dropout_p:
            rng = _draw(q, dropout_p, softcap, learnable_sink, return_attn_probs)
            return _call(dropping, q, k, v, rng, *flags[:5], float(dropout_p), flags[5])
        if learnable_sink is not None:
            args = (q, k, v, _sinks(learnable_sink), *flags)
            if not return_attn_probs:
                return _call(sink, *args)
            out, lse = _call(sink_with_lse, *args)
            return out, lse, None
        args = (q, k, v, *flags)
        if not return_attn_probs:
            return _call(dense, *args)
        out, lse = _call(with_lse, *args)
        return out, lse, None

    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                               deterministic=False, return_attn_probs=False, block_table=None, learnable_sink=None):
        """flash-attn's ``flash_attn_varlen_func``: documents packed with no padding, q
        (total_q, H, D), k (total_k, Hkv, D) and v (total_k, Hkv, Dv), cu_seqlens (B + 1,) int32;
        the out (total_q, H, Dv); with ``return_attn_probs`` (out, lse (H, total_q), None).
        ``learnable_sink``, ``dropout_p``: as for ``flash_attn_func`` (each token's weights drawn
        at its place in the pack)."""
        _unsupported(alibi_slopes, block_table)
        s, wl, wr, cap = _flags(q, softmax_scale, window_size, softcap)
        flags = (bool(causal), s, wl, wr, cap, int(bool(deterministic)))
        lengths = (int(max_seqlen_q), int(max_seqlen_k))
        if dropout_p:
            rng = _draw(q, dropout_p, softcap, learnable_sink, return_attn_probs)
            out, _ = _call(packed_dropping, q, k, v, cu_seqlens_q, cu_seqlens_k, rng, *lengths, *flags[:5],
                           float(dropout_p), flags[5])
            return out
        if learnable_sink is not None:
            out, lse = _call(packed_sink, q, k, v, cu_seqlens_q, cu_seqlens_k, _sinks(learnable_sink), *lengths,
                             *flags)
        else:
            out, lse = _call(packed, q, k, v, cu_seqlens_q, cu_seqlens_k, *lengths, *flags)
        return (out, lse, None) if return_attn_probs else out

    return {"flash_attn_func": flash_attn_func, "flash_attn_varlen_func": flash_attn_varlen_func}


def _route(T, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """(B, H, S, D) inputs of float16/bfloat16 (after autocast), no mask tensor, a supported
    head_dim (and v's that the kernels take beside it: MLA's 128 beside 192), grouped-query K/V
    with ``enable_gqa``, ``is_causal`` with equal query and key lengths (PyTorch aligns the
    causal mask to the top left, cukern to the bottom right: they agree only there); dropout
    where ``dropout_route_reason`` finds none (drawn by ``dropout_draw``)."""
    q, k, v = query, key, value
    if not (q.is_cuda and k.is_cuda and v.is_cuda):
        return "not CUDA tensors"
    dt = T.autocast_dtype("scaled_dot_product_attention", q.dtype)
    q, k, v = T.cast(q, dt), T.cast(k, dt), T.cast(v, dt)
    if attn_mask is not None:
        return "attn_mask"
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not 0.0 <= dropout_p < 1.0:
        return "dropout_p outside [0, 1)"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or k.shape[:-1] != v.shape[:-1]:
        return "shape"
    if q.dtype not in T.HALF_DTYPES or k.dtype != q.dtype or v.dtype != q.dtype:
        return f"dtype {q.dtype}"
    if not (q.device == k.device == v.device):
        return "devices differ"
    b, h, sq, d = q.shape
    bk, hkv, sk, dk = k.shape
    if bk != b or dk != d or d not in HEAD_DIMS or v.shape[-1] != CONFIGS.dv(d):
        return "batch or head_dim"
    if v.shape[-1] != d and _hopper(q.device):
        # (MLA's sizes on the Hopper kernels: forward level with cuDNN's, forward + backward still
        # behind it: docs/notes-attention.md; flash_attn_func takes them when asked)
        return "MLA's head sizes on Hopper (PyTorch's cuDNN kernel is faster there)"
    if hkv != h and not (enable_gqa and hkv > 0 and h % hkv == 0):
        return "heads"
    if is_causal and sq != sk:
        return "causal with seqlen_q != seqlen_k"
    if b * h > 65535 or sq == 0 or sk == 0:
        return "size"
    if T.small("scaled_dot_product_attention", b * h * sq * sk * d):
        return T.SMALL
    if dropout_p and (why := dropout_route_reason(q.device, d, v.shape[-1])):
        return why
    s = 1.0 / math.sqrt(d) if scale is None else float(scale)
    # (B, H, S, D) read through its transpose; the output comes back in SDPA's layout: no copies.
    if dropout_p:
        return ("attention_dropout", (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_draw(q.device),
                                      bool(is_causal), s, -1, -1, 0.0, float(dropout_p), -1), _transpose12)
    return ("attention", (q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), bool(is_causal), s, -1, -1, 0.0,
                          -1), _transpose12)


def _hopper(device) -> bool:
    """Whether ``device`` (a CUDA torch.device) is an sm_90 GPU (H100, H200)."""
    from .. import _kernels

    import torch

    return _kernels.compute_capability(device.index if device.index is not None else torch.cuda.current_device()) \
        == (9, 0)


def _transpose12(t):
    return t.transpose(1, 2)
