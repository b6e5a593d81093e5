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

The block's own torch op and the Hopper products come next (docs/moe.md has the plan); until they
do, this package is not registered as a family (its kernels' compile checks are
tests/test_moe_routing.py's and tests/test_moe_grouped_mm.py's own).
"""
