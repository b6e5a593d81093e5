"""Mixture-of-experts: routing, token permutation and grouped expert products.

Where each job lives:
    reference.py  the NumPy references (float64), forward and backward: the router (softmax or
                  sigmoid top-k, renormalized), the load-balancing and router z-losses, the
                  permutation of tokens by expert and the weighted combine back, grouped matrix
                  products over expert groups, and the whole MoE block as transformers' Mixtral
                  computes it.

The kernels, the array functions and ``cukern.torch``'s op come next (docs/moe.md has the plan);
until they do, this package is not registered as a family.
"""
