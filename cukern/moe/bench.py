"""The family's benchmark cases: the grouped expert products at the shapes of a fine-grained
MoE (64 experts, top-8, hidden 2048, expert width 768) and of Mixtral (8 experts, top-2, hidden
4096, width 14336), balanced routing (and the first also with Zipf-skewed routing), against
``torch._grouped_mm`` where the installed torch has it (a loop over the experts where it does
not, or does not run), forward and both backward products (d b as its own backward computes
it). The bench reports them in TFLOP/s against the device's dense matrix rate: the ceiling at
equal FLOPs."""
from __future__ import annotations

import functools

from .._bench_cases import Case, generator, randn
from .grouped_mm import moe_grouped_mm, moe_grouped_mm_backward

# (label, experts, rows (tokens × top_k), in_features K, out_features N, Zipf exponent of the
# experts' loads or 0 for balanced routing)
WORKLOAD = {
    "full": (("64e top8 up", 64, 16384 * 8, 2048, 2 * 768, 0),
             ("64e top8 up zipf", 64, 16384 * 8, 2048, 2 * 768, 1.2),
             ("64e top8 down", 64, 16384 * 8, 768, 2048, 0),
             ("mixtral up", 8, 8192 * 2, 4096, 2 * 14336, 0), ("mixtral down", 8, 8192 * 2, 14336, 4096, 0)),
    "quick": (("64e top8 up", 64, 2048 * 8, 512, 2 * 256, 0),
              ("64e top8 up zipf", 64, 2048 * 8, 512, 2 * 256, 1.2),
              ("64e top8 down", 64, 2048 * 8, 256, 512, 0),
              ("mixtral up", 8, 2048 * 2, 1024, 2 * 2048, 0), ("mixtral down", 8, 2048 * 2, 2048, 1024, 0)),
    "dtype": "bfloat16",
}


def expert_counts(experts: int, rows: int, zipf: float) -> list[int]:
    """Rows an expert: equal shares (zipf 0), or expert e's share proportional to (e + 1)^-zipf
    (1.2 puts 29% of the rows on the first of 64 experts and 0.2% on the last), summing to rows."""
    weights = [(e + 1) ** -zipf for e in range(experts)]
    counts = [int(rows * w / sum(weights)) for w in weights]
    for e in range(rows - sum(counts)):
        counts[e % experts] += 1
    return counts


def _inputs(experts, rows, k, n, dtype, seed, grad=False, zipf=0.0):
    import torch

    gen = generator(seed)
    counts = expert_counts(experts, rows, zipf)
    offsets = torch.tensor([0] + [sum(counts[:e + 1]) for e in range(experts)], dtype=torch.int32, device="cuda")
    t = {"a": randn((rows, k), dtype, gen), "b": randn((experts, n, k), dtype, gen) * k ** -0.5,
         "offsets": offsets, "counts": counts}
    if grad:
        t["dout"] = randn((rows, n), dtype, gen)
    return t


def _fwd(t):
    return moe_grouped_mm(t["a"], t["b"], t["offsets"])


def _fwd_bwd(t):
    return (_fwd(t), *moe_grouped_mm_backward(t["dout"], t["a"], t["b"], t["offsets"]))


def _torch_product(a, b_kn, t):
    """a (R, K) times each expert's b_kn (E, K, N) over its rows: ``torch._grouped_mm`` where it
    runs, else one product an expert."""
    return _grouped(a, b_kn, t["offsets"][1:])


def _torch_fwd(t):
    return _torch_product(t["a"], t["b"].transpose(-2, -1), t)


def _torch_weight_grad(dout, a, offsets):
    """Each expert's dout_eᵀ a_e (E, N, K): ``torch._grouped_mm`` over groups of rows (as its own
    backward computes it), else one product an expert."""
    import torch

    if hasattr(torch, "_grouped_mm"):
        try:
            return torch._grouped_mm(dout.t(), a, offs=offsets)
        except (RuntimeError, NotImplementedError):
            pass
    ends = [0, *offsets.tolist()]
    return torch.stack([dout[lo:hi].T @ a[lo:hi] for lo, hi in zip(ends, ends[1:])])


def _torch_fwd_bwd(t):
    out = _torch_fwd(t)
    da = _torch_product(t["dout"], t["b"], t)
    return out, da, _torch_weight_grad(t["dout"], t["a"], t["offsets"][1:])


def bench_cases(quick: bool) -> list:
    """FLOPs: 2 R K N a product (the forward), three products with both backward ones."""
    dt = WORKLOAD["dtype"]
    out = []
    for label, e, r, k, n, zipf in WORKLOAD["quick" if quick else "full"]:
        flops, shape = 2 * r * k * n, (e, r, k, n)
        nbytes = 2 * (r * k + e * n * k + r * n)
        out.append(Case(f"moe grouped_mm {label} fwd", "moe", shape, dt, nbytes,
                        functools.partial(_inputs, e, r, k, n, dt, zipf=zipf), _fwd, _torch_fwd, flops=flops))
        out.append(Case(f"moe grouped_mm {label} fwd+bwd", "moe", shape, dt, 3 * nbytes,
                        functools.partial(_inputs, e, r, k, n, dt, grad=True, zipf=zipf), _fwd_bwd, _torch_fwd_bwd,
                        flops=3 * flops))
    return out


# ---- the PyTorch path: transformers' fused experts, as patch(model) routes them ----------------

EXPERTS = {"full": (16384, 2048, 64, 768, 8), "quick": (2048, 512, 16, 256, 4)}   # T, H, E, I, k
MIXTRAL_EXPERTS = {"full": (8192, 4096, 8, 14336, 2), "quick": (2048, 1024, 8, 2048, 2)}   # (Mixtral 8x7B's)


def _grouped(a, b_kn, offsets):
    """a's rows times each expert's b_kn (E, K, N), ``offsets`` (E,) the groups' ends:
    ``torch._grouped_mm`` where the installed torch has it and it runs on this GPU, else one
    product an expert (which reads the offsets on the host)."""
    import torch

    if hasattr(torch, "_grouped_mm"):
        try:
            return torch._grouped_mm(a, b_kn, offs=offsets)
        except (RuntimeError, NotImplementedError):
            pass
    ends = [0, *offsets.tolist()]
    return torch.cat([a[lo:hi] @ b_kn[e] for e, (lo, hi) in enumerate(zip(ends, ends[1:]))])


def _torch_experts(x, idx, weights, gate_up, down):
    """transformers' fused experts (SwiGLU) the way a PyTorch user writes them on grouped
    products: the pairs sorted by expert, two grouped products, the weighted sum back."""
    import torch
    import torch.nn.functional as F

    e, k = gate_up.shape[0], idx.shape[1]
    flat = idx.reshape(-1)
    order = torch.argsort(flat, stable=True)
    ones = torch.ones_like(flat, dtype=torch.int32)
    counts = torch.zeros(e, dtype=torch.int32, device=x.device).scatter_add_(0, flat, ones)
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    token = order // k
    h = _grouped(x[token], gate_up.transpose(-2, -1), offsets)
    i = h.shape[1] // 2
    y = _grouped(F.silu(h[:, :i]) * h[:, i:], down.transpose(-2, -1), offsets)
    y = y * weights.reshape(-1)[order, None].to(y.dtype)
    return torch.zeros_like(x).index_add_(0, token, y)


def _experts_inputs(dims, dtype, seed):
    import torch

    t_, h, e, i, k = dims
    gen = generator(seed)
    # (balanced: token t's experts t k ... t k + k - 1, modulo E: distinct, each expert T k / E pairs)
    idx = (torch.arange(t_ * k, device="cuda") % e).reshape(t_, k)
    leaves = [randn((t_, h), dtype, gen).requires_grad_(True),
              torch.rand((t_, k), device="cuda", generator=gen).requires_grad_(True),
              (randn((e, 2 * i, h), dtype, gen) * h ** -0.5).requires_grad_(True),
              (randn((e, h, i), dtype, gen) * i ** -0.5).requires_grad_(True)]
    return {"leaves": leaves, "idx": idx, "idx32": idx.to(torch.int32), "dy": randn((t_, h), dtype, gen)}


def _experts_liger(t):
    """Liger-Kernel's fused MoE experts (Triton grouped products, SwiGLU fused into the up
    projection): the same leaves, the expert ids as int32."""
    from liger_kernel.ops.fused_moe import LigerFusedMoEFunction

    x, w, gu, dn = t["leaves"]
    return LigerFusedMoEFunction.apply(x, gu, dn, t["idx32"], w)


def _experts_on(F, t):
    """``F.moe_experts`` for cukern.torch, the PyTorch form above for torch.nn.functional."""
    x, w, gu, dn = t["leaves"]
    if F.__name__ == "torch.nn.functional":
        return _torch_experts(x, t["idx"], w, gu, dn)
    return F.moe_experts(x, t["idx"], w, gu, dn)


@functools.cache
def _transformers_experts(e: int, h: int, i: int):
    """transformers' Mixtral experts module with its Python loop over the experts
    (``_experts_implementation`` "eager"), built on the meta device: the bench passes the
    weights in (``torch.func.functional_call``), so that their gradients reach its leaves."""
    import torch
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = MixtralConfig(hidden_size=h, intermediate_size=i, num_local_experts=e, hidden_act="silu")
    config._experts_implementation = "eager"
    with torch.device("meta"):
        return MixtralExperts(config)


def _experts_or_loop(F, t):
    """``F.moe_experts`` for cukern.torch; transformers' loop for torch.nn.functional."""
    import torch

    x, w, gu, dn = t["leaves"]
    if F.__name__ == "torch.nn.functional":
        module = _transformers_experts(gu.shape[0], x.shape[1], dn.shape[2])
        return torch.func.functional_call(module, {"gate_up_proj": gu, "down_proj": dn}, (x, t["idx"], w))
    return F.moe_experts(x, t["idx"], w, gu, dn)


def _experts_array(t):
    """The same forward and backward without autograd: the op's own forward and backward
    (cukern/moe/torch.py), which call the array functions."""
    from .torch import experts_backward, experts_forward

    x, w, gu, dn = (v.detach() for v in t["leaves"])
    out, *saved = experts_forward(x, t["idx"], w, gu, dn, 0)
    return (out, *experts_backward(t["dy"], *saved, gu, dn, 0, t["idx"].shape[1]))


GPT_OSS = {"full": (8192, 2880, 32, 2880, 4), "quick": (2048, 512, 16, 256, 4)}   # T, H, E, I, k (gpt-oss-20b's)


def _biased_inputs(dims, dtype, seed):
    """GPT-OSS's experts' leaves: x, the weights, w_gate_up (E, H, 2I), its float32 bias, w_down
    (E, I, H), its float32 bias (a model under autocast holds float32 biases)."""
    import torch

    t_, h, e, i, k = dims
    gen = generator(seed)
    idx = (torch.arange(t_ * k, device="cuda") % e).reshape(t_, k)
    leaves = [randn((t_, h), dtype, gen), torch.rand((t_, k), device="cuda", generator=gen),
              randn((e, h, 2 * i), dtype, gen) * h ** -0.5, randn((e, 2 * i), "float32", gen),
              randn((e, i, h), dtype, gen) * i ** -0.5, randn((e, h), "float32", gen) * 0.1]
    return {"leaves": [v.requires_grad_(True) for v in leaves], "idx": idx, "dy": randn((t_, h), dtype, gen)}


@functools.cache
def _transformers_gpt_oss_experts(e: int, h: int, i: int):
    """transformers' GPT-OSS experts module with its default implementation (its grouped
    products where the installed torch has them), on the meta device (the weights passed in)."""
    import torch
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    config = GptOssConfig(hidden_size=h, intermediate_size=i, num_local_experts=e)
    with torch.device("meta"):
        module = GptOssExperts(config)
    config._experts_implementation = "grouped_mm"   # (what a model from transformers takes by default)
    module.config = config
    return module


def _biased_or_transformers(F, t):
    """``F.moe_experts_biased`` for cukern.torch; transformers' GPT-OSS experts for
    torch.nn.functional (under torch.compile for the compiled column)."""
    import torch

    x, w, gu, bgu, dn, bdn = t["leaves"]
    if F.__name__ == "torch.nn.functional":
        module = _transformers_gpt_oss_experts(gu.shape[0], x.shape[1], dn.shape[1])
        params = {"gate_up_proj": gu, "gate_up_proj_bias": bgu, "down_proj": dn, "down_proj_bias": bdn}
        return torch.func.functional_call(module, params, (x, t["idx"], w))
    return F.moe_experts_biased(x, t["idx"], w, gu, bgu, dn, bdn)


def _biased_array(t):
    from .torch import biased_experts_backward, biased_experts_forward

    x, w, gu, bgu, dn, bdn = (v.detach() for v in t["leaves"])
    out, *saved = biased_experts_forward(x, t["idx"], w, gu, bgu, dn, bdn, 1.702, 7.0)
    return (out, *biased_experts_backward(t["dy"], *saved, gu, bgu, dn, bdn, 1.702, 7.0, t["idx"].shape[1]))


def torch_bench_cases(quick: bool) -> list:
    """The experts' forward and backward (patch(model)'s ``moe_experts``) against the same on
    PyTorch's grouped products, eager and compiled, and against Liger-Kernel's fused MoE; and
    against transformers' Mixtral experts (its loop over the experts, eager and compiled). FLOPs:
    the three products of each pair, forward, three times that with the backward."""
    from .._bench_cases import TorchCase

    size, dt = "quick" if quick else "full", WORKLOAD["dtype"]
    out = []
    for label, dims in (("", EXPERTS[size]), (" mixtral", MIXTRAL_EXPERTS[size])):
        t_, h, e, i, k = dims
        flops = 2 * t_ * k * h * 3 * i
        nbytes = 2 * (2 * t_ * h + e * 3 * i * h + t_ * k * (h + 3 * i))
        make = functools.partial(_experts_inputs, dims, dt)
        out += [TorchCase(f"moe experts{label} fwd+bwd", "moe", dims, dt, 3 * nbytes, make, _experts_on,
                          _experts_array, liger=_experts_liger, flops=3 * flops),
                TorchCase(f"moe experts{label} fwd+bwd vs transformers loop", "moe", dims, dt, 3 * nbytes, make,
                          _experts_or_loop, _experts_array, flops=3 * flops)]
    return [*out, _gpt_oss_case(quick)]


def _gpt_oss_case(quick: bool):
    """GPT-OSS's experts (biases, the clamped gate) against transformers' own module."""
    from .._bench_cases import TorchCase

    dims, dt = GPT_OSS["quick" if quick else "full"], WORKLOAD["dtype"]
    t_, h, e, i, k = dims
    flops = 2 * t_ * k * h * 3 * i
    nbytes = 2 * (2 * t_ * h + e * 3 * i * h + t_ * k * (h + 3 * i))
    return TorchCase("moe gpt-oss experts fwd+bwd vs transformers", "moe", dims, dt, 3 * nbytes,
                     functools.partial(_biased_inputs, dims, dt), _biased_or_transformers, _biased_array,
                     flops=3 * flops)
