"""Fused attention on tensor cores (kernels: cuda_src/attention_fwd.cu, cuda_src/attention_bwd.cu,
and on sm_90 cuda_src/attention_fwd_sm90.cu, cuda_src/attention_bwd_sm90.cu).

Layout as flash-attention: q (batch, seqlen_q, heads, head_dim), k and v (batch, seqlen_k,
kv_heads, head_dim) with kv_heads dividing heads (grouped-query and multi-query attention
read the shared K/V heads in place). Every array is read and written through its batch,
sequence and head strides (unit stride over head_dim), so PyTorch's SDPA layout (B, H, S, D),
its transpose of a (B, S, H, D) projection, and packed qkv views need no copy; outputs take
the stride order of the input they belong to (out and dq like q, dk like k, dv like v) when
that input is dense, else they are contiguous. dtypes: float16, bfloat16 (the tensor-core
types); softmax and accumulation in float32. The log-sum-exp is float32 (batch, heads, seqlen_q).

The family's Python side, a module a job:

* ``configs``: the kernel sources, tile configurations by head dim and path (sm_80, Hopper),
  the shipped ``CONFIGS`` (read at each call: tools and tests replace ``configs.CONFIGS``) and
  the kernel instances;
* ``checks``: the argument checks the kernels' front and the references share;
* ``forward``: ``attention`` and ``attention_varlen``, their launch plans;
* ``backward``: ``attention_backward`` and ``attention_varlen_backward``, their launch plans;
* ``reference``: the NumPy references;
* ``bench``: the benchmark cases (array API, masks, the PyTorch path);
* ``torch``: the custom ops, the exported functions and the SDPA drop-in's route.

The masks (causal, windows, softcap) are ``cukern._attention_mask``. ``FAMILY`` below registers
the family. ``cukern.attention`` is the function (the package exports it); reach a job with
``from cukern.attention import forward`` or ``importlib.import_module("cukern.attention")``.
"""
# ruff: noqa: F401 (the package re-exports its jobs' names that tools and tests reach)
from __future__ import annotations

from .._family import DropIn, Family
# (the names a tool or a test reaches through the package, besides the API; configs.CONFIGS is
# read from its module at each call)
from .backward import (_BWD, _BWD_VARLEN, _attention_backward, _plan_backward, attention_backward,
                       attention_varlen_backward)
from .bench import bench_cases, mask_bench_cases, torch_bench_cases
from .configs import (BWD_HEAD_DIMS, HEAD_DIMS, BwdConfig, Configs, DqConfig, FwdConfig, Sm90BwdConfig,
                      Sm90FwdConfig, instances, row_elems)
from .forward import (_FWD, _FWD_VARLEN, _attention, _plan_forward, _plan_forward_varlen, attention,
                      attention_varlen)
from .reference import (reference_attention, reference_attention_backward, reference_attention_varlen,
                        reference_attention_varlen_backward)
from .torch import TORCH_OPS, _route, _torch_api

__all__ = ["attention", "attention_backward", "attention_varlen", "attention_varlen_backward"]

FAMILY = Family(
    name="attention",
    api=(attention, attention_backward, attention_varlen, attention_varlen_backward),
    references={"attention": reference_attention, "attention_backward": reference_attention_backward,
                "attention_varlen": reference_attention_varlen,
                "attention_varlen_backward": reference_attention_varlen_backward},
    instances=instances,
    bench=bench_cases,
    torch_bench=torch_bench_cases,
    torch_ops=TORCH_OPS,
    torch_api=_torch_api,
    # Under torch.compile PyTorch runs SDPA on cuDNN's Hopper kernels, faster than these
    # FlashAttention-2-class kernels (docs/torch.md): compiled graphs keep PyTorch's.
    # min_size in B*H*Sq*Sk*D (a quarter of the forward's FLOPs).
    dropins=(DropIn("scaled_dot_product_attention", _route, compile=False, probe=lambda f, x: f(x, x, x),
                    min_size=2**28),),
)
