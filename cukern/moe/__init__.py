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

The grouped expert products, the block as one call and ``cukern.torch``'s op come next
(docs/moe.md has the plan); until they do, this package is not registered as a family (its
kernels' compile check is tests/test_moe_routing.py's own).
"""
