"""Attention's benchmark cases: the array API against SDPA, the masks (windows, softcap, packed
documents) and the PyTorch path."""
from __future__ import annotations

import functools

import numpy as np

from .._bench_cases import Case, TorchCase, elements_bytes, generator, randn
from .backward import attention_backward, attention_varlen_backward
from .forward import attention, attention_varlen

# ---- benchmark cases ----------------------------------------------------------------------------

# (batch, heads, seqlen, head_dim, causal): batch * seqlen = 64k tokens, and long sequences.
# (an optional sixth: the K/V heads, grouped-query attention; H by default)
WORKLOAD = {"full": [(32, 16, 2048, 128, False), (32, 16, 2048, 128, True), (4, 32, 8192, 128, True),
                     (16, 32, 2048, 64, True), (8, 16, 4096, 256, True), (4, 32, 8192, 128, True, 8)],
            "quick": [(4, 16, 2048, 128, False), (4, 16, 2048, 128, True), (1, 32, 4096, 128, True),
                      (4, 32, 2048, 64, True), (1, 16, 4096, 256, True), (1, 32, 4096, 128, True, 8)],
            "dtype": "bfloat16"}


def _inputs(B, H, S, D, dtype, seed, *, grad=False, sdpa=False, hkv=None, dv=None) -> dict:
    """q (B, S, H, D), k (B, S, hkv, D), v (B, S, hkv, dv) (dv: D unless given); with ``sdpa``
    the PyTorch-path layout instead: (B, H, S, D) leaves."""
    gen = generator(seed)
    hkv = H if hkv is None else hkv
    dv = D if dv is None else dv
    shapes = {n: ((B, h, S, e) if sdpa else (B, S, h, e)) for n, h, e in (("q", H, D), ("k", hkv, D), ("v", hkv, dv),
                                                                         ("do", H, dv))}
    t = {n: randn(shapes[n], dtype, gen) for n in ("q", "k", "v")}
    if grad:
        t["do"] = t["dy"] = randn(shapes["do"], dtype, gen)
        t["leaves"] = tuple(t[n].detach().requires_grad_(True) for n in ("q", "k", "v"))
    return t


def _sdpa(t, causal, backend, leaves=False):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    which = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    q, k, v = t["leaves"] if leaves else (t[n] for n in ("q", "k", "v"))
    gqa = {"enable_gqa": True} if k.shape[2] != q.shape[2] else {}
    with sdpa_kernel(which):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                              is_causal=causal, **gqa).transpose(1, 2)


def fa4_functions():
    """FlashAttention-4's ``flash_attn_func`` and ``flash_attn_varlen_func`` (``flash_attn.cute``,
    the flash-attn-4 package); ImportError, saying so, where it does not import (its row then
    reports that instead of a time)."""
    try:
        from flash_attn.cute import flash_attn_func, flash_attn_varlen_func
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken installation
        raise ImportError(f"FlashAttention-4 is not installed here (flash_attn.cute: {type(e).__name__}: {e}; "
                          "pip install flash-attn-4)") from None
    return flash_attn_func, flash_attn_varlen_func


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _fa4(t, causal, window=None, sinks=False, backward=False):
    """FlashAttention-4 on (B, S, H, D) inputs (packed documents where ``t`` has "cu"): the
    output, and with ``backward`` the gradients of q, k, v (and of the sinks) by its autograd."""
    import torch

    dense, packed = fa4_functions()
    q, k, v = t["leaves"] if backward else (t[n] for n in ("q", "k", "v"))
    kw = {"causal": causal}
    if window is not None:
        kw["window_size"] = window
    if sinks:
        kw["learnable_sink"] = t["sink_leaf"] if backward else t["sinks_bf16"]
    if "cu" in t:
        out = _first(packed(q, k, v, cu_seqlens_q=t["cu"], cu_seqlens_k=t["cu"], max_seqlen_q=t["max"],
                            max_seqlen_k=t["max"], **kw))
    else:
        out = _first(dense(q, k, v, **kw))
    if not backward:
        return out
    leaves = (*t["leaves"], t["sink_leaf"]) if sinks else t["leaves"]
    return (out.detach(), *torch.autograd.grad(out, leaves, t["do"]))


def _fwd(t, causal):
    return attention(t["q"], t["k"], t["v"], causal=causal)


def _fwd_bwd(t, causal):
    out, lse = attention(t["q"], t["k"], t["v"], causal=causal, return_lse=True)
    return (out, *attention_backward(t["do"], t["q"], t["k"], t["v"], out, lse, causal=causal))


def _torch_fwd_bwd(t, causal, backend):
    import torch

    out = _sdpa(t, causal, backend, leaves=True)
    return (out.detach(), *torch.autograd.grad(out, t["leaves"], t["do"]))


def bench_cases(quick: bool) -> list:
    """FLOP-bound: 4·B·H·S²·D (half when causal) forward, FlashAttention's count for the
    backward (2.5 x forward), against torch's SDPA with the FLASH_ATTENTION backend
    (FlashAttention-2) and the CUDNN_ATTENTION backend."""
    dt = WORKLOAD["dtype"]
    cases = []
    for B, H, S, D, causal, *kv in WORKLOAD["quick" if quick else "full"]:
        hkv = kv[0] if kv else H
        flops = 4 * B * H * S * S * D // (2 if causal else 1)
        long = " long" if S > 2048 else ""  # (the same label for the --quick shape of a case)
        tag = f"attention{' causal' if causal else ''}{long}{' gqa' if hkv != H else ''} d{D}"
        make = functools.partial(_inputs, B, H, S, D, dt, hkv=hkv)
        for backend in ("flash", "cudnn", "fa4"):
            peer = (functools.partial(_fa4, causal=causal) if backend == "fa4"
                    else functools.partial(_sdpa, causal=causal, backend=backend))
            cases.append(Case(f"{tag} fwd vs {backend}", "attention", (B, H, S, D), dt,
                              elements_bytes((4 * B, S, H, D), dt), make,
                              functools.partial(_fwd, causal=causal), peer, flops=flops))
        for backend in ("flash", "cudnn", "fa4"):
            peer = (functools.partial(_fa4, causal=causal, backward=True) if backend == "fa4"
                    else functools.partial(_torch_fwd_bwd, causal=causal, backend=backend))
            cases.append(Case(f"{tag} fwd+bwd vs {backend}", "attention", (B, H, S, D), dt,
                              elements_bytes((8 * B, S, H, D), dt), functools.partial(make, grad=True),
                              functools.partial(_fwd_bwd, causal=causal), peer, flops=int(3.5 * flops)))
    return (cases + deterministic_bench_cases(quick) + mask_bench_cases(quick) + sink_bench_cases(quick)
            + mla_bench_cases(quick) + dropout_bench_cases(quick))


# ---- dropout (GPT-2's configs train with 0.1): against SDPA with the same dropout ----------------

DROPOUT = {"full": [(16, 16, 2048, 64, True), (8, 16, 2048, 128, True), (8, 16, 2048, 128, False)],
           "quick": [(4, 16, 2048, 64, True), (2, 16, 2048, 128, True), (2, 16, 2048, 128, False)],
           "p": 0.1}


def _dropout_inputs(B, H, S, D, dtype, seed, *, grad=False) -> dict:
    """``_inputs`` and the draw's (seed, offset), (2,) int64 on the device."""
    import torch

    t = _inputs(B, H, S, D, dtype, seed, grad=grad)
    t["rng"] = torch.tensor([seed, 0], dtype=torch.int64, device=t["q"].device)
    return t


def _dropout_fwd(t, causal):
    return attention(t["q"], t["k"], t["v"], causal=causal, dropout_p=DROPOUT["p"], dropout_rng=t["rng"])


def _dropout_fwd_bwd(t, causal):
    kw = dict(causal=causal, dropout_p=DROPOUT["p"], dropout_rng=t["rng"])
    out, lse = attention(t["q"], t["k"], t["v"], return_lse=True, **kw)
    return (out, *attention_backward(t["do"], t["q"], t["k"], t["v"], out, lse, **kw))


def _sdpa_dropout(t, causal, backward=False):
    """PyTorch's SDPA with the same dropout (its own backend choice: FlashAttention-2's kernels)."""
    import torch
    import torch.nn.functional as F

    q, k, v = t["leaves"] if backward else (t[n] for n in ("q", "k", "v"))
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                                         dropout_p=DROPOUT["p"]).transpose(1, 2)
    if not backward:
        return out
    return (out.detach(), *torch.autograd.grad(out, t["leaves"], t["do"]))


def dropout_bench_cases(quick: bool) -> list:
    """Attention with dropout 0.1, forward and forward+backward, against PyTorch's SDPA with the
    same dropout (FLOPs as ``bench_cases`` counts them; the draw is not counted; the two draw
    different masks, so the outputs are not compared)."""
    dt, cases = WORKLOAD["dtype"], []
    for B, H, S, D, causal in DROPOUT["quick" if quick else "full"]:
        flops = 4 * B * H * S * S * D // (2 if causal else 1)
        tag = f"attention dropout{' causal' if causal else ''} d{D}"
        make = functools.partial(_dropout_inputs, B, H, S, D, dt)
        cases.append(Case(f"{tag} fwd vs sdpa", "attention", (B, H, S, D), dt, elements_bytes((4 * B, S, H, D), dt),
                          make, functools.partial(_dropout_fwd, causal=causal),
                          functools.partial(_sdpa_dropout, causal=causal), flops=flops, compares=False))
        cases.append(Case(f"{tag} fwd+bwd vs sdpa", "attention", (B, H, S, D), dt,
                          elements_bytes((8 * B, S, H, D), dt), functools.partial(make, grad=True),
                          functools.partial(_dropout_fwd_bwd, causal=causal),
                          functools.partial(_sdpa_dropout, causal=causal, backward=True), flops=int(3.5 * flops),
                          compares=False))
    return cases


def _with_forward(make, causal, seed):
    """``make``'s inputs with the forward's out and lse (the backward's inputs)."""
    t = make(seed, grad=True)
    t["out"], t["lse"] = attention(t["q"], t["k"], t["v"], causal=causal, return_lse=True)
    return t


def _bwd(t, causal, deterministic):
    return attention_backward(t["do"], t["q"], t["k"], t["v"], t["out"], t["lse"], causal=causal,
                              deterministic=deterministic)


def deterministic_bench_cases(quick: bool) -> list:
    """The backward alone, deterministic=True against the default (dQ summed in any order), at
    bench_cases' shapes: 2.5x the forward's FLOPs."""
    dt = WORKLOAD["dtype"]
    cases = []
    for B, H, S, D, causal, *kv in WORKLOAD["quick" if quick else "full"]:
        hkv = kv[0] if kv else H
        flops = 4 * B * H * S * S * D // (2 if causal else 1)
        long = " long" if S > 2048 else ""
        tag = f"attention{' causal' if causal else ''}{long}{' gqa' if hkv != H else ''} d{D}"
        make = functools.partial(_with_forward, functools.partial(_inputs, B, H, S, D, dt, hkv=hkv), causal)
        cases.append(Case(f"{tag} bwd deterministic vs default", "attention", (B, H, S, D), dt,
                          elements_bytes((8 * B, S, H, D), dt), make,
                          functools.partial(_bwd, causal=causal, deterministic=True),
                          functools.partial(_bwd, causal=causal, deterministic=False), flops=int(2.5 * flops)))
    return cases


# DeepSeek's MLA head sizes in training (q and k 192: 128 of content and 64 of rope; v 128), causal,
# against cuDNN (through SDPA) and FlashAttention-4 where they take them.
MLA_WORKLOAD = {"full": (4, 16, 4096, 192, 128), "quick": (1, 16, 2048, 192, 128)}


def mla_bench_cases(quick: bool) -> list:
    """FLOPs 2·B·H·S²·(D + Dv), half causal (S = Q Kᵀ on D, O = P V on Dv); forward+backward at
    3.5x the forward, as bench_cases."""
    B, H, S, D, DV = MLA_WORKLOAD["quick" if quick else "full"]
    dt = WORKLOAD["dtype"]
    flops = 2 * B * H * S * S * (D + DV) // 2
    make = functools.partial(_inputs, B, H, S, D, dt, dv=DV)
    tag = f"attention causal mla d{D}/{DV}"
    cases = []
    for backend in ("cudnn", "fa4"):
        peer = (functools.partial(_fa4, causal=True) if backend == "fa4"
                else functools.partial(_sdpa, causal=True, backend=backend))
        cases.append(Case(f"{tag} fwd vs {backend}", "attention", (B, H, S, D), dt,
                          elements_bytes((B, S, H, 2 * D + 2 * DV), dt), make,
                          functools.partial(_fwd, causal=True), peer, flops=flops))
    for backend in ("cudnn", "fa4"):
        peer = (functools.partial(_fa4, causal=True, backward=True) if backend == "fa4"
                else functools.partial(_torch_fwd_bwd, causal=True, backend=backend))
        cases.append(Case(f"{tag} fwd+bwd vs {backend}", "attention", (B, H, S, D), dt,
                          elements_bytes((B, S, H, 4 * D + 4 * DV), dt), functools.partial(make, grad=True),
                          functools.partial(_fwd_bwd, causal=True), peer, flops=int(3.5 * flops)))
    with_forward = functools.partial(_with_forward, make, True)
    cases.append(Case(f"{tag} bwd deterministic vs default", "attention", (B, H, S, D), dt,
                      elements_bytes((B, S, H, 6 * D + 4 * DV), dt), with_forward,
                      functools.partial(_bwd, causal=True, deterministic=True),
                      functools.partial(_bwd, causal=True, deterministic=False), flops=int(2.5 * flops)))
    return cases


# Attention sinks at GPT-OSS's shape (64 query heads of 64 over 8 KV heads, a learned sink a head),
# causal, against FlashAttention-4's learnable_sink.
SINK_WORKLOAD = {"full": (8, 64, 8, 2048, 64), "quick": (2, 64, 8, 1024, 64)}


def _sink_inputs(B, H, HKV, S, D, dtype, seed) -> dict:
    import torch

    gen = generator(seed)
    t = {"q": randn((B, S, H, D), dtype, gen), "k": randn((B, S, HKV, D), dtype, gen),
         "v": randn((B, S, HKV, D), dtype, gen), "do": randn((B, S, H, D), dtype, gen)}
    t["leaves"] = tuple(t[n].detach().requires_grad_(True) for n in ("q", "k", "v"))
    # (bfloat16 values, as FlashAttention-4 takes them: both see the same sinks)
    t["sinks_bf16"] = (randn((H,), "float32", gen) * 2).to(torch.bfloat16)
    t["sinks"] = t["sinks_bf16"].float()
    t["sink_leaf"] = t["sinks_bf16"].detach().requires_grad_(True)
    return t


def _sink_fwd(t):
    return attention(t["q"], t["k"], t["v"], causal=True, sinks=t["sinks"])


def _sink_fwd_bwd(t):
    out, lse = attention(t["q"], t["k"], t["v"], causal=True, return_lse=True, sinks=t["sinks"])
    return (out, *attention_backward(t["do"], t["q"], t["k"], t["v"], out, lse, causal=True, sinks=t["sinks"]))


def sink_bench_cases(quick: bool) -> list:
    B, H, HKV, S, D = SINK_WORKLOAD["quick" if quick else "full"]
    dt = WORKLOAD["dtype"]
    flops = 4 * B * H * S * S * D // 2
    make = functools.partial(_sink_inputs, B, H, HKV, S, D, dt)
    return [Case(f"attention causal sinks gqa d{D} fwd vs fa4", "attention", (B, H, S, D), dt,
                 elements_bytes((2 * B, S, H + HKV, D), dt), make, _sink_fwd,
                 functools.partial(_fa4, causal=True, sinks=True), flops=flops),
            Case(f"attention causal sinks gqa d{D} fwd+bwd vs fa4", "attention", (B, H, S, D), dt,
                 elements_bytes((4 * B, S, H + HKV, D), dt), make, _sink_fwd_bwd,
                 functools.partial(_fa4, causal=True, sinks=True, backward=True), flops=int(3.5 * flops))]


# The masks' and packed documents' cases, each at the shape of the case it is measured against:
# documents of random lengths summing to 32768 tokens (16 of them, H32 d128, causal) against
# FlashAttention-2's varlen kernel; the same tokens as 16 documents of 2048 against the dense
# causal kernel on (16, 2048) (the same work: the packed path's own cost); a window of 1024 at
# S8192 against the full causal case of that shape; the softcap (Gemma 2's 50) against the
# same causal case without it.
MASK_WORKLOAD = {"full": dict(docs=16, tokens=32768, heads=32, d=128, long=(4, 32, 8192), window=1024,
                              dense=(32, 16, 2048)),
                 "quick": dict(docs=8, tokens=8192, heads=16, d=128, long=(1, 16, 4096), window=512,
                               dense=(4, 16, 2048))}


def _doc_lengths(docs: int, tokens: int, seed: int = 0) -> list[int]:
    """``docs`` random lengths, multiples of 8 and at least 64, that sum to ``tokens`` (the same
    every run)."""
    rng = np.random.default_rng(seed)
    while True:
        cuts = np.sort(rng.choice(np.arange(1, tokens // 8), size=docs - 1, replace=False)) * 8
        lengths = np.diff(np.concatenate([[0], cuts, [tokens]]))
        if lengths.min() >= 64:
            return [int(x) for x in lengths]


def _packed_inputs(lengths, H, D, dtype, seed, *, grad=False) -> dict:
    import torch

    gen = generator(seed)
    total = sum(lengths)
    t = {n: randn((total, H, D), dtype, gen) for n in ("q", "k", "v")}
    t["cu"] = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device="cuda")
    t["max"] = max(lengths)
    if grad:
        t["do"] = randn((total, H, D), dtype, gen)
        t["leaves"] = tuple(t[n].detach().requires_grad_(True) for n in ("q", "k", "v"))
    return t


def _varlen_fwd(t):
    return attention_varlen(t["q"], t["k"], t["v"], t["cu"], t["cu"], t["max"], t["max"], causal=True)


def _varlen_fwd_bwd(t):
    out, lse = attention_varlen(t["q"], t["k"], t["v"], t["cu"], t["cu"], t["max"], t["max"], causal=True,
                                return_lse=True)
    return (out, *attention_varlen_backward(t["do"], t["q"], t["k"], t["v"], out, lse, t["cu"], t["cu"], t["max"],
                                            t["max"], causal=True))


def _fa2_varlen(t, window=None, backward=False):
    """PyTorch's FlashAttention-2 (aten::_flash_attention_forward / _backward) on packed
    documents, causal, with a window if given; (B, S, H, D) inputs as B documents of S."""
    import torch

    dense = "cu" not in t
    names = ("q", "k", "v", "do") if backward else ("q", "k", "v")
    if dense:
        B, S = t["q"].shape[:2]
        flat = {n: t[n].reshape(B * S, *t[n].shape[2:]) for n in names}
        cu = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device=t["q"].device)
        mq = S
    else:
        flat, cu, mq = {n: t[n] for n in names}, t["cu"], t["max"]
    wl, wr = window if window is not None else (None, None)
    q, k, v = flat["q"], flat["k"], flat["v"]
    out, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu, cu, mq, mq, 0.0, True, False, window_size_left=wl, window_size_right=wr)
    res = (out,)
    if backward:
        res += tuple(torch.ops.aten._flash_attention_backward(
            flat["do"], q, k, v, out, lse, cu, cu, mq, mq, 0.0, True, rng, unused, window_size_left=wl,
            window_size_right=wr))
    if dense:
        res = tuple(x.view(B, S, *x.shape[1:]) for x in res)
    return res if backward else res[0]


def _window_fwd_bwd(t, window):
    out, lse = attention(t["q"], t["k"], t["v"], causal=True, return_lse=True, window=window)
    return (out, *attention_backward(t["do"], t["q"], t["k"], t["v"], out, lse, causal=True, window=window))


def _softcap_fwd_bwd(t, softcap):
    out, lse = attention(t["q"], t["k"], t["v"], causal=True, return_lse=True, softcap=softcap)
    return (out, *attention_backward(t["do"], t["q"], t["k"], t["v"], out, lse, causal=True, softcap=softcap))


def _window_flops(B, H, S, D, window) -> int:
    """4·D FLOPs a (query, key) pair each query sees: causal with ``window`` keys before it."""
    pairs = sum(min(i, window) + 1 for i in range(S))
    return 4 * B * H * pairs * D


def mask_bench_cases(quick: bool) -> list:
    """The masks' and packed documents' cases (MASK_WORKLOAD), FLOPs counted over the
    (query, key) pairs each computes; forward+backward at 3.5x the forward, as bench_cases."""
    w = MASK_WORKLOAD["quick" if quick else "full"]
    dt, H, D = WORKLOAD["dtype"], w["heads"], w["d"]
    cases = []
    lengths = _doc_lengths(w["docs"], w["tokens"])
    flops = sum(4 * H * L * L * D // 2 for L in lengths)
    nbytes = elements_bytes((4 * w["tokens"], H, D), dt)
    make = functools.partial(_packed_inputs, lengths, H, D, dt)
    shape = (w["docs"], H, w["tokens"] // w["docs"], D)
    cases.append(Case("attention varlen causal d128 fwd vs flash", "attention", shape, dt, nbytes, make,
                             _varlen_fwd, _fa2_varlen, flops=flops))
    cases.append(Case("attention varlen causal d128 fwd+bwd vs flash", "attention", shape, dt, 2 * nbytes,
                             functools.partial(make, grad=True), _varlen_fwd_bwd,
                             functools.partial(_fa2_varlen, backward=True), flops=int(3.5 * flops)))
    cases.append(Case("attention varlen causal d128 fwd vs fa4", "attention", shape, dt, nbytes, make,
                      _varlen_fwd, functools.partial(_fa4, causal=True), flops=flops))
    cases.append(Case("attention varlen causal d128 fwd+bwd vs fa4", "attention", shape, dt, 2 * nbytes,
                      functools.partial(make, grad=True), _varlen_fwd_bwd,
                      functools.partial(_fa4, causal=True, backward=True), flops=int(3.5 * flops)))
    even = [w["tokens"] // w["docs"]] * w["docs"]
    S = even[0]
    flops_even = w["docs"] * 4 * H * S * S * D // 2
    cases.append(Case("attention varlen equal causal d128 fwd+bwd vs dense", "attention", shape, dt,
                             2 * nbytes, functools.partial(_packed_inputs, even, H, D, dt, grad=True),
                             _varlen_fwd_bwd, functools.partial(_as_dense_fwd_bwd, batch=w["docs"]),
                             flops=int(3.5 * flops_even)))
    B, HL, SL = w["long"]
    window = (w["window"], 0)
    wflops = _window_flops(B, HL, SL, D, w["window"])
    for label, fn, peer, f, name in (
            ("fwd", lambda t: attention(t["q"], t["k"], t["v"], causal=True, window=window),
             functools.partial(_fa2_varlen, window=window), wflops, "flash"),
            ("fwd+bwd", functools.partial(_window_fwd_bwd, window=window),
             functools.partial(_fa2_varlen, window=window, backward=True), int(3.5 * wflops), "flash"),
            ("fwd", lambda t: attention(t["q"], t["k"], t["v"], causal=True, window=window),
             functools.partial(_fa4, causal=True, window=window), wflops, "fa4"),
            ("fwd+bwd", functools.partial(_window_fwd_bwd, window=window),
             functools.partial(_fa4, causal=True, window=window, backward=True), int(3.5 * wflops), "fa4")):
        cases.append(Case(f"attention causal window long d128 {label} vs {name}", "attention",
                                 (B, HL, SL, D), dt, elements_bytes((8 * B, SL, HL, D), dt),
                                 functools.partial(_inputs, B, HL, SL, D, dt, grad=label != "fwd"), fn, peer, flops=f))
    B, HD, SD = w["dense"]
    cflops = 4 * B * HD * SD * SD * D // 2
    cases.append(Case("attention causal softcap50 d128 fwd+bwd vs no softcap", "attention", (B, HD, SD, D), dt,
                             elements_bytes((8 * B, SD, HD, D), dt),
                             functools.partial(_inputs, B, HD, SD, D, dt, grad=True),
                             functools.partial(_softcap_fwd_bwd, softcap=50.0),
                             functools.partial(_softcap_fwd_bwd, softcap=0.0), flops=int(3.5 * cflops)))
    return cases


def _as_dense_fwd_bwd(t, batch):
    """The packed inputs of equal documents seen as (batch, S, H, D): the dense causal kernel."""
    q, k, v, do = (t[n].view(batch, -1, *t[n].shape[1:]) for n in ("q", "k", "v", "do"))
    out, lse = attention(q, k, v, causal=True, return_lse=True)
    grads = attention_backward(do, q, k, v, out, lse, causal=True)
    return tuple(x.reshape(-1, *x.shape[2:]) for x in (out, *grads))


def _sdpa_forward_on(F, t, causal, dropout_p=0.0):
    """The PyTorch user's call: F.scaled_dot_product_attention on (B, H, S, D) leaves."""
    q, k, v = t["leaves"]
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=dropout_p)


def _sdpa_array(t, causal):
    """The same work through the array API, on the same (B, H, S, D) tensors read through
    their transposes (no copies)."""
    q, k, v, do = (t[n].transpose(1, 2) for n in ("q", "k", "v", "dy"))
    out, lse = attention(q, k, v, causal=causal, return_lse=True)
    dq, dk, dv = attention_backward(do, q, k, v, out, lse, causal=causal)
    return tuple(a.transpose(1, 2) for a in (out, dq, dk, dv))


def _sdpa_array_dropout(t, causal):
    """``_sdpa_array`` with dropout, the draw a (2,) int64 array made as the drop-in makes it."""
    from .torch import dropout_draw

    q, k, v, do = (t[n].transpose(1, 2) for n in ("q", "k", "v", "dy"))
    kw = dict(causal=causal, dropout_p=DROPOUT["p"], dropout_rng=dropout_draw(q.device))
    out, lse = attention(q, k, v, return_lse=True, **kw)
    return tuple(a.transpose(1, 2) for a in (out, *attention_backward(do, q, k, v, out, lse, **kw)))


def _flash_forward_on(F, t, window=None):
    """A flash-attn user's call, causal: ``cukern.torch``'s flash_attn_varlen_func (packed inputs:
    ``t`` has "cu") or flash_attn_func; for F = torch.nn.functional, which has neither, PyTorch's
    own FlashAttention-2 kernel (aten's, under autograd), the kernel flash-attn's package runs."""
    import torch

    q, k, v = t["leaves"]
    w = window if window is not None else (-1, -1)
    if hasattr(F, "flash_attn_varlen_func"):
        if "cu" in t:
            return F.flash_attn_varlen_func(q, k, v, t["cu"], t["cu"], t["max"], t["max"], causal=True, window_size=w)
        return F.flash_attn_func(q, k, v, causal=True, window_size=w)
    dense = "cu" not in t
    B, S = q.shape[:2]
    if dense:
        q, k, v = (x.reshape(B * S, *x.shape[2:]) for x in (q, k, v))
    cu = torch.arange(0, (B + 1) * S, S, dtype=torch.int32, device=q.device) if dense else t["cu"]
    mq = S if dense else t["max"]
    wl, wr = window if window is not None else (None, None)
    out = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, mq, mq, 0.0, True, False, window_size_left=wl,
                                                  window_size_right=wr)[0]
    return out.view(B, S, *out.shape[1:]) if dense else out


def _fa4_forward(t, causal=True, window=None, sdpa=False):
    """The same call through FlashAttention-4 (its autograd): ``sdpa`` leaves are (B, H, S, D),
    read through their transposes as cukern's are."""
    dense, packed = fa4_functions()
    q, k, v = (x.transpose(1, 2) for x in t["leaves"]) if sdpa else t["leaves"]
    kw = {"causal": causal} if window is None else {"causal": causal, "window_size": window}
    if "cu" in t:
        return _first(packed(q, k, v, cu_seqlens_q=t["cu"], cu_seqlens_k=t["cu"], max_seqlen_q=t["max"],
                             max_seqlen_k=t["max"], **kw))
    out = _first(dense(q, k, v, **kw))
    return out.transpose(1, 2) if sdpa else out


def _with_leaves(make, seed):
    t = make(seed)
    t["dy"] = t["do"]
    t["leaves"] = tuple(t[n].detach().requires_grad_(True) for n in ("q", "k", "v"))
    return t


def torch_bench_cases(quick: bool) -> list:
    """The SDPA drop-in (B, H, S, D) forward + backward against PyTorch's own choice of kernel
    (cuDNN on Hopper), torch.compile, and the array API on the same tensors, and with dropout
    (DROPOUT's d128 causal case; each draws its own mask, so the outputs are not compared);
    flash-attn's functions on packed documents and a sliding window (MASK_WORKLOAD's) against
    PyTorch's FlashAttention-2 kernel."""
    B, H, S, D, causal = WORKLOAD["quick" if quick else "full"][1]
    dt = WORKLOAD["dtype"]
    flops = int(3.5 * 4 * B * H * S * S * D // 2)
    cases = [TorchCase(f"sdpa causal d{D} fwd+bwd", "attention", (B, H, S, D), dt,
                              elements_bytes((8 * B, S, H, D), dt),
                              functools.partial(_inputs, B, H, S, D, dt, grad=True, sdpa=True),
                              functools.partial(_sdpa_forward_on, causal=causal),
                              functools.partial(_sdpa_array, causal=causal), flops=flops,
                              fa4=functools.partial(_fa4_forward, causal=causal, sdpa=True))]
    B, H, S, D, causal = DROPOUT["quick" if quick else "full"][1]
    p = DROPOUT["p"]
    cases.append(TorchCase(f"sdpa causal d{D} dropout {p} fwd+bwd", "attention", (B, H, S, D), dt,
                           elements_bytes((8 * B, S, H, D), dt),
                           functools.partial(_inputs, B, H, S, D, dt, grad=True, sdpa=True),
                           functools.partial(_sdpa_forward_on, causal=causal, dropout_p=p),
                           functools.partial(_sdpa_array_dropout, causal=causal),
                           flops=int(3.5 * 4 * B * H * S * S * D // 2), compares=False))
    w = MASK_WORKLOAD["quick" if quick else "full"]
    lengths = _doc_lengths(w["docs"], w["tokens"])
    H, D = w["heads"], w["d"]
    cases.append(TorchCase(
        f"flash_attn_varlen_func causal d{D} fwd+bwd", "attention", (w["docs"], H, w["tokens"] // w["docs"], D), dt,
        2 * elements_bytes((4 * w["tokens"], H, D), dt),
        functools.partial(_with_leaves, functools.partial(_packed_inputs, lengths, H, D, dt, grad=True)),
        _flash_forward_on, _varlen_fwd_bwd, flops=int(3.5 * sum(4 * H * L * L * D // 2 for L in lengths)),
        fa4=_fa4_forward))
    B, HL, SL = w["long"]
    window = (w["window"], 0)
    cases.append(TorchCase(
        f"flash_attn_func causal window d{D} fwd+bwd", "attention", (B, HL, SL, D), dt,
        elements_bytes((8 * B, SL, HL, D), dt),
        functools.partial(_inputs, B, HL, SL, D, dt, grad=True),
        functools.partial(_flash_forward_on, window=window), functools.partial(_window_fwd_bwd, window=window),
        flops=int(3.5 * _window_flops(B, HL, SL, D, w["window"])),
        fa4=functools.partial(_fa4_forward, window=window)))
    return cases
