"""Mixture-of-experts: routing, token permutation and grouped expert products.

Where each job lives:
    reference.py  the NumPy references (float64), forward and backward: the router (softmax or
                  sigmoid top-k, renormalized), the load-balancing and router z-losses, the
                  permutation of tokens by expert and the weighted combine back, grouped matrix
                  products over expert groups, and the whole MoE block as transformers' Mixtral
                  computes it.
    routing.py    the router and the token permutation on the kernels (cuda_src/moe.cu): array
                  functions with their launch plans, forward and backward, no host
                  synchronization (``moe_router``, ``moe_permute``, ``moe_unpermute``, their
                  backwards).
    grouped_mm.py the grouped expert products on tensor cores (cuda_src/moe_grouped_mm.cu):
                  each expert's rows times its weight, and both backward products, the groups'
                  sizes read on the device (``moe_grouped_mm``, ``moe_grouped_mm_backward``).

    block.py      the MoE block as one call composed of those kernels: ``moe_forward`` (the
                  output and what the backward needs) and ``moe_backward``.
    torch.py      transformers' fused experts on those kernels under autograd (``moe_experts``:
                  what ``cukern.torch.patch(model)`` routes a model's experts to).

    bench.py      the benchmark cases (the grouped products against ``torch._grouped_mm``).

The block's own torch op and the Hopper products come next (docs/moe.md has the plan).
"""
from .._family import Family
from . import block as _block
from . import grouped_mm as _grouped_mm
from . import routing as _routing
from .bench import bench_cases as _bench_cases
from .bench import torch_bench_cases as _torch_bench_cases


def instances() -> list:
    """Every kernel instance of the family (routing's and the grouped products')."""
    return _routing.instances() + _grouped_mm.instances()


def _torch_api(T, ops, modules) -> dict:
    """``cukern.torch.moe_experts``: transformers' fused experts on the kernels, with autograd."""
    from .torch import moe_experts

    return {"moe_experts": moe_experts}


FAMILY = Family(
    name="moe",
    api=(_routing.moe_router, _routing.moe_router_backward, _routing.moe_permute, _routing.moe_permute_backward,
         _routing.moe_unpermute, _routing.moe_unpermute_backward, _grouped_mm.moe_grouped_mm,
         _grouped_mm.moe_grouped_mm_backward, _block.moe_forward, _block.moe_backward),
    # (the references, cukern.moe.reference, return what the tests compare, not every output of
    # the fronts of the same names; cukern.reference takes them when their signatures agree)
    references={},
    instances=instances,
    bench=_bench_cases,
    torch_bench=_torch_bench_cases,
    torch_api=_torch_api,
)
