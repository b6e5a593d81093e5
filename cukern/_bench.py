"""The benchmark mechanism shared by ``python -m cukern bench`` and the asv suite (asv_bench/).

Every case times cukern against the PyTorch equivalent in one process, on torch tensors (cukern
takes them zero-copy), with CUDA events on torch's current stream: the median of many runs
after warm-up. Each result is also given as a ratio to a ceiling measured in the same run: the
device's device-to-device copy bandwidth for memory-bound ops (bytes read + written), the bf16
matrix-product rate for FLOP-bound ones (PERFORMANCE.md says why ratios, not absolute times).

The cases live in one table, ``cases()``; a family adds its rows there, with its shapes in
``WORKLOAD``. torch and CuPy are imported only inside the functions that run on the GPU, so
``import cukern`` (and ``import cukern._bench``) never imports them.
"""
from __future__ import annotations

import functools
import math
import re
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from . import __version__
from .attention import attention, attention_backward
from .embedding import embedding, embedding_backward
from .group_norm import group_norm, group_norm_backward
from .norm import layer_norm, layer_norm_backward, rms_norm, rms_norm_backward

__all__ = ["Case", "Timing", "WORKLOAD", "cases", "time_cuda", "time_cuda_detail", "copy_bandwidth",
           "matmul_rate", "run_cases", "run_case", "summarize", "format_table", "unavailable_reason",
           "asv_results"]

# The workload of DESIGN.md, per family: the full shapes, and the smaller ones of --quick.
WORKLOAD = {
    "norm": {"full": (65536, 4096), "quick": (8192, 4096), "dtype": "bfloat16"},
    # (N, C, H, W) and groups: the diffusion/UNet block of PERFORMANCE.md
    "group_norm": {"full": (16, 512, 64, 64), "quick": (4, 512, 64, 64), "groups": 32, "dtype": "bfloat16"},
    # (batch, heads, seqlen, head_dim, causal): the attention cases of the issue
    "attention": {"full": [(32, 16, 2048, 128, False), (32, 16, 2048, 128, True),
                           (4, 32, 8192, 128, True), (16, 32, 2048, 64, True)],
                  "quick": [(4, 16, 2048, 128, False), (4, 16, 2048, 128, True),
                            (1, 32, 4096, 128, True), (4, 32, 2048, 64, True)], "dtype": "bfloat16"},
    # (tokens, vocabulary, model dim)
    "embedding": {"full": (65536, 128256, 4096), "quick": (8192, 32000, 4096), "dtype": "bfloat16"},
}

ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}
SHORT_DTYPE = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}

# Rotate among input sets until one round touches at least this many times the L2 size.
L2_FACTOR = 4
MAX_INPUT_SETS = 16

# Largest relative L2 difference from torch's outputs still reported as agreeing (per dtype;
# both sides round their outputs to the dtype).
AGREE = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 2e-2}


# ---- cases ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    """One benchmark: cukern and torch doing the same work on the same inputs.

    ``make(seed)`` builds one input set (a dict of random torch CUDA tensors); ``cukern_fn``
    and ``torch_fn`` take that dict and return the output tensor or a tuple of outputs in the
    same order (compared once, outside the timing). ``nbytes`` is the floor of bytes that must
    move (PERFORMANCE.md); ``flops`` is set for FLOP-bound cases, which are then reported in
    TFLOP/s against the matrix rate instead of GB/s against the copy bandwidth.
    """
    name: str
    family: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    make: Callable[[int], dict]
    cukern_fn: Callable[[dict], Any]
    torch_fn: Callable[[dict], Any]
    flops: int | None = None

    @property
    def shape_label(self) -> str:
        return "x".join(str(n) for n in self.shape)


def elements_bytes(shape: Sequence[int], dtype: str, passes: int | float = 1) -> int:
    """Bytes of ``passes`` full reads or writes of an array of ``shape`` and ``dtype``."""
    return int(passes * math.prod(shape) * ITEMSIZE[dtype])


def slug(name: str) -> str:
    """A case name as an identifier: ``"layer_norm fwd+bwd"`` -> ``"layer_norm_fwd_bwd"``."""
    return re.sub(r"[^0-9A-Za-z]+", "_", name).strip("_")


def cases(quick: bool = False, family: str | None = None) -> list[Case]:
    """Every benchmark case, in table order; ``quick`` takes the smaller shapes of WORKLOAD."""
    size = "quick" if quick else "full"
    table: list[Case] = []

    # -- norms: (N, D); passes of N*D elements: fwd 2 (x, y), fwd+bwd 5 (+ dy, x, dx),
    #    fused residual 4 (x, r in; y, h out). Weights and statistics are O(N + D), left out.
    w = WORKLOAD["norm"]
    nd, dt = w[size], w["dtype"]
    inputs = functools.partial(_norm_inputs, nd, dt)
    table += [
        Case("layer_norm fwd", "norm", nd, dt, elements_bytes(nd, dt, 2),
             functools.partial(inputs, bias=True), _ln_fwd, _torch_ln_fwd),
        Case("rms_norm fwd", "norm", nd, dt, elements_bytes(nd, dt, 2),
             functools.partial(inputs, bias=False), _rms_fwd, _torch_rms_fwd),
        Case("layer_norm fwd+bwd", "norm", nd, dt, elements_bytes(nd, dt, 5),
             functools.partial(inputs, bias=True, grad=True), _ln_fwdbwd, _torch_ln_fwdbwd),
        Case("rms_norm fwd+bwd", "norm", nd, dt, elements_bytes(nd, dt, 5),
             functools.partial(inputs, bias=False, grad=True), _rms_fwdbwd, _torch_rms_fwdbwd),
        Case("layer_norm +residual fwd", "norm", nd, dt, elements_bytes(nd, dt, 4),
             functools.partial(inputs, bias=True, residual=True), _ln_res, _torch_ln_res),
        Case("rms_norm +residual fwd", "norm", nd, dt, elements_bytes(nd, dt, 4),
             functools.partial(inputs, bias=False, residual=True), _rms_res, _torch_rms_res),
    ]

    # -- group norm: (N, C, H, W); passes of the tensor as for the norms: fwd 2, fwd+bwd 5.
    #    Contiguous and channels-last inputs (torch's channels_last memory format).
    w = WORKLOAD["group_norm"]
    shape, dt, groups = w[size], w["dtype"], w["groups"]
    for cl in (False, True):
        gin = functools.partial(_gn_inputs, shape, dt, groups, channels_last=cl)
        tag = " channels_last" if cl else ""
        table += [
            Case(f"group_norm{tag} fwd", "group_norm", shape, dt, elements_bytes(shape, dt, 2),
                 gin, _gn_fwd, _torch_gn_fwd),
            Case(f"group_norm{tag} fwd+bwd", "group_norm", shape, dt, elements_bytes(shape, dt, 5),
                 functools.partial(gin, grad=True), _gn_fwdbwd, _torch_gn_fwdbwd),
        ]

    # -- embedding: T tokens from a (V, D) table. fwd: read T rows, write T rows (2 T·D);
    #    bwd (dense): read T grad rows, write the V·D table gradient ((T + V)·D).
    w = WORKLOAD["embedding"]
    (T, V, D), dt = w[size], w["dtype"]
    emb = functools.partial(_embedding_inputs, T, V, D, dt)
    fwd_bytes, bwd_bytes = elements_bytes((2 * T, D), dt), elements_bytes((T + V, D), dt)
    table += [
        Case("embedding fwd", "embedding", (T, V, D), dt, fwd_bytes, emb, _emb_fwd, _torch_emb_fwd),
        Case("embedding bwd", "embedding", (T, V, D), dt, bwd_bytes,
             functools.partial(emb, grad=True), _emb_bwd, _torch_emb_bwd),
        Case("embedding bwd zipf", "embedding", (T, V, D), dt, bwd_bytes,
             functools.partial(emb, grad=True, zipf=True), _emb_bwd, _torch_emb_bwd),
        Case("embedding fwd+bwd", "embedding", (T, V, D), dt, fwd_bytes + bwd_bytes,
             functools.partial(emb, grad=True), _emb_fwdbwd, _torch_emb_fwdbwd),
    ]
    # -- attention forward: FLOP-bound, 4·B·H·S²·D (half when causal), against torch's SDPA
    #    with the FLASH_ATTENTION backend (FlashAttention-2) and the CUDNN_ATTENTION backend.
    w = WORKLOAD["attention"]
    dt = w["dtype"]
    for B, H, S, D, causal in w[size]:
        flops = 4 * B * H * S * S * D // (2 if causal else 1)
        long = " long" if S > 2048 else ""  # (the same label for the --quick shape of a case)
        tag = f"attention{' causal' if causal else ''}{long} d{D}"
        make = functools.partial(_attn_inputs, B, H, S, D, dt)
        for backend in ("flash", "cudnn"):
            table.append(Case(f"{tag} fwd vs {backend}", "attention", (B, H, S, D), dt,
                              elements_bytes((4 * B, S, H, D), dt), make,
                              functools.partial(_attn_fwd, causal=causal),
                              functools.partial(_torch_attn_fwd, causal=causal, backend=backend),
                              flops=flops))
        # forward + backward: FLOPs counted as FlashAttention does, backward = 2.5 x forward
        for backend in ("flash", "cudnn"):
            table.append(Case(f"{tag} fwd+bwd vs {backend}", "attention", (B, H, S, D), dt,
                              elements_bytes((8 * B, S, H, D), dt), functools.partial(make, grad=True),
                              functools.partial(_attn_fwdbwd, causal=causal),
                              functools.partial(_torch_attn_fwdbwd, causal=causal, backend=backend),
                              flops=int(3.5 * flops)))
    return [c for c in table if family is None or c.family == family]


def _randn(shape, dtype: str, gen):
    import torch

    return torch.randn(shape, dtype=getattr(torch, dtype), device="cuda", generator=gen)


def _generator(seed: int):
    import torch

    gen = torch.Generator(device="cuda")
    gen.manual_seed(1234 + seed)
    return gen


def _norm_inputs(shape, dtype, seed, *, bias, grad=False, residual=False) -> dict:
    gen = _generator(seed)
    d = shape[-1]
    t = {"x": _randn(shape, dtype, gen), "w": _randn((d,), dtype, gen),
         "b": _randn((d,), dtype, gen) if bias else None}
    if residual:
        t["r"] = _randn(shape, dtype, gen)
    if grad:
        t["dy"] = _randn(shape, dtype, gen)
        # torch's autograd leaves, sharing storage with the cukern inputs
        t["xg"] = t["x"].detach().requires_grad_(True)
        t["wg"] = t["w"].detach().requires_grad_(True)
        t["bg"] = t["b"].detach().requires_grad_(True) if bias else None
    return t


def _ln_fwd(t):
    return layer_norm(t["x"], t["w"], t["b"])


def _torch_ln_fwd(t):
    import torch.nn.functional as F

    x = t["x"]
    return F.layer_norm(x, (x.shape[-1],), t["w"], t["b"])


def _rms_fwd(t):
    return rms_norm(t["x"], t["w"])


def _torch_rms_fwd(t):
    import torch.nn.functional as F

    x = t["x"]
    return F.rms_norm(x, (x.shape[-1],), t["w"], eps=1e-6)


def _ln_fwdbwd(t):
    y, mean, rstd = layer_norm(t["x"], t["w"], t["b"], return_stats=True)
    dx, dw, db = layer_norm_backward(t["dy"], t["x"], t["w"], mean, rstd)
    return y, dx, dw, db


def _torch_ln_fwdbwd(t):
    import torch
    import torch.nn.functional as F

    x, w, b = t["xg"], t["wg"], t["bg"]
    y = F.layer_norm(x, (x.shape[-1],), w, b)
    dx, dw, db = torch.autograd.grad(y, (x, w, b), t["dy"])
    return y.detach(), dx, dw, db


def _rms_fwdbwd(t):
    y, rstd = rms_norm(t["x"], t["w"], return_stats=True)
    dx, dw = rms_norm_backward(t["dy"], t["x"], t["w"], rstd)
    return y, dx, dw


def _torch_rms_fwdbwd(t):
    import torch
    import torch.nn.functional as F

    x, w = t["xg"], t["wg"]
    y = F.rms_norm(x, (x.shape[-1],), w, eps=1e-6)
    dx, dw = torch.autograd.grad(y, (x, w), t["dy"])
    return y.detach(), dx, dw


def _ln_res(t):
    return layer_norm(t["x"], t["w"], t["b"], residual=t["r"])


def _torch_ln_res(t):
    import torch.nn.functional as F

    h = t["x"] + t["r"]
    return F.layer_norm(h, (h.shape[-1],), t["w"], t["b"]), h


def _rms_res(t):
    return rms_norm(t["x"], t["w"], residual=t["r"])


def _torch_rms_res(t):
    import torch.nn.functional as F

    h = t["x"] + t["r"]
    return F.rms_norm(h, (h.shape[-1],), t["w"], eps=1e-6), h


def _gn_inputs(shape, dtype, groups, seed, *, channels_last=False, grad=False) -> dict:
    gen = _generator(seed)
    x = _randn(shape, dtype, gen)
    if channels_last:  # (N, C, *S) stored as (N, *S, C)
        x = x.movedim(1, -1).contiguous().movedim(-1, 1)
    c = shape[1]
    t = {"x": x, "w": _randn((c,), dtype, gen), "b": _randn((c,), dtype, gen), "g": groups}
    if grad:
        dy = _randn(shape, dtype, gen)
        t["dy"] = dy.movedim(1, -1).contiguous().movedim(-1, 1) if channels_last else dy
        t["xg"] = t["x"].detach().requires_grad_(True)
        t["wg"] = t["w"].detach().requires_grad_(True)
        t["bg"] = t["b"].detach().requires_grad_(True)
    return t


def _gn_fwd(t):
    return group_norm(t["x"], t["g"], t["w"], t["b"])


def _torch_gn_fwd(t):
    import torch.nn.functional as F

    return F.group_norm(t["x"], t["g"], t["w"], t["b"])


def _gn_fwdbwd(t):
    y, mean, rstd = group_norm(t["x"], t["g"], t["w"], t["b"], return_stats=True)
    dx, dw, db = group_norm_backward(t["dy"], t["x"], t["g"], t["w"], mean, rstd)
    return y, dx, dw, db


def _torch_gn_fwdbwd(t):
    import torch
    import torch.nn.functional as F

    x, w, b = t["xg"], t["wg"], t["bg"]
    y = F.group_norm(x, t["g"], w, b)
    dx, dw, db = torch.autograd.grad(y, (x, w, b), t["dy"])
    return y.detach(), dx, dw, db


def _attn_inputs(B, H, S, D, dtype, seed, *, grad=False) -> dict:
    gen = _generator(seed)
    t = {k: _randn((B, S, H, D), dtype, gen) for k in ("q", "k", "v")}
    if grad:
        t["do"] = _randn((B, S, H, D), dtype, gen)
        for k in ("q", "k", "v"):  # torch's autograd leaves, sharing storage
            t[k + "g"] = t[k].detach().requires_grad_(True)
    return t


def _attn_fwdbwd(t, causal):
    out, lse = attention(t["q"], t["k"], t["v"], causal=causal, return_lse=True)
    return (out,) + attention_backward(t["do"], t["q"], t["k"], t["v"], out, lse, causal=causal)


def _torch_attn_fwdbwd(t, causal, backend):
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    which = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    q, k, v = (t[n + "g"] for n in ("q", "k", "v"))
    with sdpa_kernel(which):
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=causal).transpose(1, 2)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), t["do"])
    return out.detach(), dq, dk, dv


def _attn_fwd(t, causal):
    return attention(t["q"], t["k"], t["v"], causal=causal)


def _torch_attn_fwd(t, causal, backend):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    which = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend]
    with sdpa_kernel(which):
        out = F.scaled_dot_product_attention(*(t[k].transpose(1, 2) for k in ("q", "k", "v")), is_causal=causal)
    return out.transpose(1, 2)


def _embedding_inputs(T, V, D, dtype, seed, *, grad=False, zipf=False) -> dict:
    import numpy as np
    import torch

    gen = _generator(seed)
    if zipf:  # a Zipf-like token distribution, as in real text (a few very hot tokens)
        ranks = np.random.default_rng(seed).zipf(1.2, T) % V
        idx = torch.from_numpy(ranks.astype(np.int64)).cuda()
    else:
        idx = torch.randint(0, V, (T,), device="cuda", generator=gen)
    t = {"idx": idx, "w": _randn((V, D), dtype, gen)}
    if grad:
        t["dy"] = _randn((T, D), dtype, gen)
        t["wg"] = t["w"].detach().requires_grad_(True)
    return t


def _emb_fwd(t):
    return embedding(t["idx"], t["w"])


def _torch_emb_fwd(t):
    import torch.nn.functional as F

    return F.embedding(t["idx"], t["w"])


def _emb_bwd(t):
    return embedding_backward(t["dy"], t["idx"], t["w"].shape[0])


def _torch_emb_bwd(t):
    import torch

    return torch.ops.aten.embedding_dense_backward(t["dy"], t["idx"], t["w"].shape[0], -1, False)


def _emb_fwdbwd(t):
    return embedding(t["idx"], t["w"]), embedding_backward(t["dy"], t["idx"], t["w"].shape[0])


def _torch_emb_fwdbwd(t):
    import torch
    import torch.nn.functional as F

    y = F.embedding(t["idx"], t["wg"])
    (dw,) = torch.autograd.grad(y, (t["wg"],), t["dy"])
    return y.detach(), dw


# ---- pure arithmetic (no GPU) ----------------------------------------------------------------

def gbps(nbytes: int, ms: float) -> float:
    """Bytes moved in ``ms`` milliseconds, in GB/s (10^9 bytes a second)."""
    return nbytes / (ms * 1e-3) / 1e9


def tflops(flops: int, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def input_set_count(set_bytes: int, l2_bytes: int, factor: int = L2_FACTOR,
                    cap: int = MAX_INPUT_SETS) -> int:
    """How many input sets to rotate so that one round touches ``factor`` times the L2 size."""
    if set_bytes <= 0:
        return 1
    return max(1, min(cap, -(-factor * l2_bytes // set_bytes)))


def summarize(case: Case, cukern_ms: float, torch_ms: float, *, copy_gbps: float | None = None,
              matmul_tflops: float | None = None) -> dict:
    """The result record of one case from its two median times (and the ceilings)."""
    r = {"name": case.name, "family": case.family, "shape": list(case.shape), "dtype": case.dtype,
         "bytes": case.nbytes, "flops": case.flops, "cukern_ms": cukern_ms, "torch_ms": torch_ms,
         "gbps": None, "torch_gbps": None, "pct_of_copy": None,
         "tflops": None, "torch_tflops": None, "pct_of_matmul": None,
         "speedup": torch_ms / cukern_ms if cukern_ms > 0 else None}
    if case.flops is None:
        r["gbps"] = gbps(case.nbytes, cukern_ms)
        r["torch_gbps"] = gbps(case.nbytes, torch_ms)
        if copy_gbps:
            r["pct_of_copy"] = 100.0 * r["gbps"] / copy_gbps
    else:
        r["tflops"] = tflops(case.flops, cukern_ms)
        r["torch_tflops"] = tflops(case.flops, torch_ms)
        if matmul_tflops:
            r["pct_of_matmul"] = 100.0 * r["tflops"] / matmul_tflops
    return r


def error_result(case: Case, error: str) -> dict:
    return {"name": case.name, "family": case.family, "shape": list(case.shape),
            "dtype": case.dtype, "bytes": case.nbytes, "flops": case.flops, "error": error}


def format_table(results: list[dict]) -> str:
    """The results as a fixed-width text table (one row a case)."""
    head = ("case", "shape", "cukern ms", "torch ms", "rate", "% of ceiling", "speed-up")
    rows = []
    for r in results:
        shape = "x".join(str(n) for n in r["shape"]) + " " + SHORT_DTYPE.get(r["dtype"], r["dtype"])
        if r.get("error"):
            rows.append((r["name"], shape, "error", "", "", "", ""))
            continue
        if r.get("tflops") is not None:
            rate = f"{r['tflops']:.0f} TFLOP/s"
            pct = f"{r['pct_of_matmul']:.1f}% matmul" if r.get("pct_of_matmul") is not None else "-"
        else:
            rate = f"{r['gbps']:.0f} GB/s"
            pct = f"{r['pct_of_copy']:.1f}% copy" if r.get("pct_of_copy") is not None else "-"
        speed = f"{r['speedup']:.2f}x" if r.get("speedup") is not None else "-"
        rows.append((r["name"], shape, f"{r['cukern_ms']:.3f}", f"{r['torch_ms']:.3f}", rate, pct,
                     speed))
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    left = {0, 1}

    def line(row):
        return "  ".join(c.ljust(w) if i in left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(row, widths))).rstrip()

    out = [line(head), "  ".join("-" * w for w in widths)]
    out += [line(row) for row in rows]
    notes = []
    for r in results:
        if r.get("error"):
            notes.append(f"{r['name']}: {r['error']}")
        elif r.get("rel_err") is not None and not r.get("agrees", True):
            notes.append(f"{r['name']}: cukern and torch outputs differ (relative L2 error "
                         f"{r['rel_err']:.2e}); the timing compares different answers")
    if notes:
        out.append("")
        out += [f"! {n}" for n in notes]
    return "\n".join(out)


# ---- the environment -------------------------------------------------------------------------

def unavailable_reason() -> str | None:
    """None when a CUDA GPU, a CUDA build of torch and CuPy are all there; else what is missing."""
    problems = []
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - ImportError, or a broken installation
        torch = None
        problems.append(f"PyTorch is not installed ({type(e).__name__}: {e}); the benchmark "
                        "compares against torch and times with torch.cuda events")
    try:
        import cupy
    except Exception as e:  # noqa: BLE001
        cupy = None
        problems.append(f"CuPy is not installed ({type(e).__name__}: {e}); cukern launches its "
                        "kernels through it (pip install cupy-cuda12x or cupy-cuda13x)")
    gpu = None
    if cupy is not None:
        try:
            n = cupy.cuda.runtime.getDeviceCount()
            gpu = None if n > 0 else "the CUDA runtime reports 0 devices"
        except Exception as e:  # noqa: BLE001 - no driver, no device: the same answer
            gpu = f"{type(e).__name__}: {e}"
    if torch is not None:
        if torch.version.cuda is None:
            problems.append(f"PyTorch {torch.__version__} is a build without CUDA "
                            "(torch.version.cuda is None); install a CUDA build")
        elif gpu is None and not torch.cuda.is_available():
            gpu = "torch.cuda.is_available() is False"
    if gpu is not None:
        problems.insert(0, f"no CUDA GPU found ({gpu})")
    return "; ".join(problems) if problems else None


def device_info(device: int = 0) -> dict:
    import torch

    p = torch.cuda.get_device_properties(device)
    return {"name": p.name, "capability": f"{p.major}.{p.minor}", "sms": p.multi_processor_count,
            "memory_bytes": p.total_memory, "l2_bytes": p.L2_cache_size}


def versions() -> dict:
    import cupy
    import torch

    from . import _nvrtc

    try:
        nvrtc = "%d.%d" % _nvrtc.version()
    except Exception as e:  # noqa: BLE001
        nvrtc = f"unavailable ({e})"
    return {"cukern": __version__, "torch": torch.__version__, "torch_cuda": torch.version.cuda,
            "cupy": cupy.__version__, "nvrtc": nvrtc}


# ---- timing ----------------------------------------------------------------------------------

@dataclass
class Timing:
    """CUDA-event times of one function: the median, every sample, and the host's time per
    call (Python overhead and launch, taken from the warm-up, not part of the samples)."""
    median_ms: float
    samples_ms: list[float]
    host_ms: float


_sleep_cycles_per_ms: float | None = None


def _cycles_per_ms() -> float:
    """The rate of ``torch.cuda._sleep`` (GPU clock cycles a millisecond), measured once; 0
    when torch has no such function."""
    global _sleep_cycles_per_ms
    if _sleep_cycles_per_ms is None:
        import torch

        try:
            torch.cuda._sleep(1000)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            cycles = 10_000_000
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            _sleep_cycles_per_ms = cycles / max(start.elapsed_time(end), 1e-3)
        except Exception:  # noqa: BLE001 - a private function: do without it
            _sleep_cycles_per_ms = 0.0
    return _sleep_cycles_per_ms


def _hold_device(ms: float) -> None:
    """Keep the current stream busy for about ``ms`` so that the host can queue the timed calls
    ahead of the device: the events then time the kernels, not the host's launch overhead."""
    rate = _cycles_per_ms()
    if rate and ms > 0:
        import torch

        torch.cuda._sleep(int(min(ms, 2000.0) * rate))


def time_cuda_detail(fn: Callable, *, warmup: int = 10, reps: int = 100,
                     input_sets: Sequence | None = None) -> Timing:
    """Time ``fn`` with a CUDA event pair around each of ``reps`` calls after ``warmup`` calls.

    With ``input_sets``, call ``i`` is ``fn(input_sets[i % len(input_sets)])``; else ``fn()``.
    Events are recorded on torch's current stream, where cukern launches for torch tensors.
    Before the timed calls the stream is held busy (``torch.cuda._sleep``) for as long as the
    host needs to queue them, so a sample is the device's time for one call.
    """
    import torch

    sets = list(input_sets) if input_sets is not None else None

    def call(i):
        return fn(sets[i % len(sets)]) if sets is not None else fn()

    call(0)                      # the first call compiles and allocates
    torch.cuda.synchronize()
    warmup = max(1, warmup)
    t0 = time.perf_counter()
    for i in range(warmup):
        call(1 + i)
    host_ms = (time.perf_counter() - t0) * 1e3 / warmup
    torch.cuda.synchronize()

    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    _hold_device(1.0 + 1.25 * host_ms * reps)
    for i in range(reps):
        starts[i].record()
        call(1 + warmup + i)
        ends[i].record()
    torch.cuda.synchronize()
    samples = [s.elapsed_time(e) for s, e in zip(starts, ends)]
    return Timing(statistics.median(samples), samples, host_ms)


def time_cuda(fn: Callable, *, warmup: int = 10, reps: int = 100,
              input_sets: Sequence | None = None) -> float:
    """The median time of ``fn`` in milliseconds; see ``time_cuda_detail``."""
    return time_cuda_detail(fn, warmup=warmup, reps=reps, input_sets=input_sets).median_ms


def l2_bytes(device: int = 0) -> int:
    import torch

    return torch.cuda.get_device_properties(device).L2_cache_size


def copy_bandwidth(nbytes: int = 1 << 30, *, warmup: int = 5, reps: int = 50) -> float:
    """The device-to-device copy rate, GB/s, counting bytes read + written: ``dst.copy_(src)``
    of ``nbytes`` (at least 8 times the L2 size) of random data."""
    import torch

    nbytes = max(nbytes, 8 * l2_bytes())
    src = _randn((nbytes // 2,), "bfloat16", _generator(0))
    dst = torch.empty_like(src)
    ms = time_cuda(lambda: dst.copy_(src), warmup=warmup, reps=reps)
    return gbps(2 * src.numel() * src.element_size(), ms)


def matmul_rate(n: int = 8192, *, warmup: int = 5, reps: int = 30) -> float:
    """The bf16 matrix-product rate, TFLOP/s, of torch's ``n``x``n``x``n`` product."""
    import torch

    gen = _generator(0)
    a, b = _randn((n, n), "bfloat16", gen), _randn((n, n), "bfloat16", gen)
    ms = time_cuda(lambda: torch.mm(a, b), warmup=warmup, reps=reps)
    return tflops(2 * n ** 3, ms)


# ---- running cases ---------------------------------------------------------------------------

def _as_tuple(out) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def relative_error(ours, theirs) -> float:
    """The largest relative L2 difference ``|a - b| / |b|`` over corresponding outputs
    (inf for a shape mismatch or a missing output; NaN never counts as agreeing)."""
    import torch

    ours, theirs = _as_tuple(ours), _as_tuple(theirs)
    if len(ours) != len(theirs):
        return math.inf
    worst = 0.0
    for a, b in zip(ours, theirs):
        if a is None or b is None:
            if a is not b:
                return math.inf
            continue
        if tuple(a.shape) != tuple(b.shape):
            return math.inf
        a, b = a.detach().float(), b.detach().float()
        ref = torch.linalg.vector_norm(b).item()
        diff = torch.linalg.vector_norm(a - b).item()
        err = diff / ref if ref > 0 else diff
        if math.isnan(err):
            return math.nan
        worst = max(worst, err)
    return worst


def run_case(case: Case, *, warmup: int = 10, reps: int = 100, copy_gbps: float | None = None,
             matmul_tflops: float | None = None, l2: int | None = None) -> dict:
    """Build the inputs, check cukern against torch once, time both; the result record."""
    import torch

    nsets = input_set_count(case.nbytes, l2 if l2 is not None else l2_bytes())
    sets = [case.make(seed) for seed in range(nsets)]
    err = relative_error(case.cukern_fn(sets[0]), case.torch_fn(sets[0]))
    torch.cuda.synchronize()
    tc = time_cuda_detail(case.cukern_fn, warmup=warmup, reps=reps, input_sets=sets)
    tt = time_cuda_detail(case.torch_fn, warmup=warmup, reps=reps, input_sets=sets)
    r = summarize(case, tc.median_ms, tt.median_ms, copy_gbps=copy_gbps, matmul_tflops=matmul_tflops)
    r.update(rel_err=err, agrees=bool(err <= AGREE.get(case.dtype, 2e-2)), input_sets=nsets,
             reps=reps, cukern_host_us=1e3 * tc.host_ms, torch_host_us=1e3 * tt.host_ms)
    return r


def run_cases(cases: Sequence[Case], progress: Callable[[int, int, Case], None] | None = None, *,
              warmup: int = 10, reps: int = 100, copy_gbps: float | None = None,
              matmul_tflops: float | None = None) -> list[dict]:
    """Run every case; a list of result dicts (see ``summarize``) in the order given.

    The ceilings are measured here when not given and some case needs them. ``progress(i, n,
    case)`` is called before case ``i`` (from 1) of ``n``. A case that raises gets a record
    with ``error`` set, and the others still run.
    """
    import torch

    if copy_gbps is None and any(c.flops is None for c in cases):
        copy_gbps = copy_bandwidth()
    if matmul_tflops is None and any(c.flops is not None for c in cases):
        matmul_tflops = matmul_rate()
    l2 = l2_bytes()
    results = []
    for i, case in enumerate(cases):
        if progress is not None:
            progress(i + 1, len(cases), case)
        try:
            results.append(run_case(case, warmup=warmup, reps=reps, copy_gbps=copy_gbps,
                                    matmul_tflops=matmul_tflops, l2=l2))
        except Exception as e:  # noqa: BLE001 - report it in the table, run the next case
            results.append(error_result(case, f"{type(e).__name__}: {e}".strip()))
        torch.cuda.empty_cache()
    return results


def asv_results(cases: Sequence[Case], *, warmup: int = 10, reps: int = 100) -> dict:
    """Everything one asv ``setup_cache`` measures: ``{"skip": reason}`` with no GPU, else the
    ceilings, the device and the result record of each case by name."""
    reason = unavailable_reason()
    if reason:
        return {"skip": reason}
    copy = copy_bandwidth()
    mm = matmul_rate() if any(c.flops is not None for c in cases) else None
    results = run_cases(cases, warmup=warmup, reps=reps, copy_gbps=copy, matmul_tflops=mm)
    return {"skip": None, "device": device_info(), "versions": versions(), "copy_gbps": copy,
            "matmul_tflops": mm, "cases": {r["name"]: r for r in results}}


# ---- asv -------------------------------------------------------------------------------------

ASV_TIMEOUT = 1800  # seconds: the first run of a kernel instance compiles it (NVRTC)


def asv_module(family: str, namespace: dict) -> None:
    """Fill an asv benchmark module's namespace with the ``family``'s cases as metrics.

    For each case: ``track_<case>_gbps`` (or ``_tflops``) and ``track_<case>_speedup``, plus
    ``track_copy_gbps``. asv runs every benchmark in a fresh process, so everything is measured
    once, in the module's ``setup_cache`` (``asv_results(cases(family=...))``), whose result
    each track_ function reads; without a GPU ``setup`` skips them all. The module defines
    ``setup_cache`` itself: asv keys the cache by the function's module and line, so one
    defined here would be shared by every family's module.
    """
    cases_ = cases(family=family)

    def setup(measured):
        if measured.get("skip"):
            raise NotImplementedError(measured["skip"])

    def track_copy_gbps(measured):
        return measured["copy_gbps"]

    namespace["setup_cache"].timeout = ASV_TIMEOUT
    track_copy_gbps.unit = "GB/s"
    track_copy_gbps.timeout = ASV_TIMEOUT
    track_copy_gbps.pretty_name = f"{family}: device-to-device copy bandwidth (the ceiling)"
    namespace.update(timeout=ASV_TIMEOUT, setup=setup, track_copy_gbps=track_copy_gbps)

    for case in cases_:
        rate = "tflops" if case.flops else "gbps"
        for key, unit, what in ((rate, "TFLOP/s" if case.flops else "GB/s", rate),
                                ("speedup", "x", "speedup")):
            def track(measured, _name=case.name, _key=key):
                r = measured["cases"][_name]
                if r.get("error"):
                    raise RuntimeError(f"{_name}: {r['error']}")
                return r[_key]

            track.__name__ = track.__qualname__ = f"track_{slug(case.name)}_{what}"
            track.unit = unit
            track.timeout = ASV_TIMEOUT
            track.pretty_name = f"{family}: {case.name} ({case.shape_label} {case.dtype}), {what}"
            namespace[track.__name__] = track
